// RegionRegistry: registration limits, lifetimes, and the resolution of
// region references into rows (shared-memory regions; CUDA IPC regions are
// covered through the service on the GPU machine).
#include "server/regions/region_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "tests/testing/shm_object.h"

namespace mlakv::server {
namespace {

using mlakv::testing::ShmObject;

RegionRegistry::Options Allowed(uint32_t max_regions = 8, uint64_t max_bytes = 1 << 30) {
  return {.allow_ipc = true, .max_regions = max_regions, .max_region_bytes = max_bytes};
}

// Waits until the registry's worker has run what was posted so far.
void Drain(RegionRegistry& r) {
  absl::Notification done;
  r.worker().Post([&] { done.Notify(); });
  done.WaitForNotification();
}

TEST(RegionRegistry, EverythingIsRefusedWithoutAllowIpc) {
  ShmObject obj(4096);
  RegionRegistry r({.allow_ipc = false});
  EXPECT_EQ(r.RegisterShm("a", {.shm_name = obj.name()}).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(r.List().status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(r.Unregister("a").status().code(), absl::StatusCode::kPermissionDenied);
  LayerRows out;
  RegionHold hold;
  LayerRowsRequest in{.ckv_ref = RegionRef{"a"}};
  EXPECT_EQ(r.ResolveRows([] { return std::string("s"); }, in, 1, Device::Cpu(), &out, &hold).code(), absl::StatusCode::kPermissionDenied);
}

TEST(RegionRegistry, NamesAreUniqueAndBounded) {
  ShmObject obj(4096);
  RegionRegistry r(Allowed());
  ASSERT_TRUE(r.RegisterShm("a", {.shm_name = obj.name()}).ok());
  EXPECT_EQ(r.RegisterShm("a", {.shm_name = obj.name()}).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(r.RegisterShm("", {.shm_name = obj.name()}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.RegisterShm(std::string(257, 'n'), {.shm_name = obj.name()}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.size(), 1u);
}

TEST(RegionRegistry, CountAndBytesAreBoundedAndFreedOnRelease) {
  ShmObject obj(8192);
  RegionRegistry r(Allowed(/*max_regions=*/2, /*max_bytes=*/12288));
  ASSERT_TRUE(r.RegisterShm("a", {.shm_name = obj.name()}).ok());
  const absl::Status bytes = r.RegisterShm("b", {.shm_name = obj.name()}).status();  // 16384 > 12288
  EXPECT_EQ(bytes.code(), absl::StatusCode::kResourceExhausted) << bytes;
  ASSERT_TRUE(r.RegisterShm("b", {.shm_name = obj.name(), .byte_size = 4096}).ok());
  const absl::Status count = r.RegisterShm("c", {.shm_name = obj.name(), .byte_size = 1}).status();
  EXPECT_EQ(count.code(), absl::StatusCode::kResourceExhausted) << count;
  EXPECT_TRUE(absl::StrContains(count.message(), "max_regions")) << count;
  EXPECT_EQ(r.alive(), 2u);
  EXPECT_EQ(r.alive_bytes(), 12288u);
  ASSERT_TRUE(r.Unregister("a").ok());
  Drain(r);
  EXPECT_EQ(r.alive(), 1u);
  EXPECT_TRUE(r.RegisterShm("c", {.shm_name = obj.name(), .byte_size = 1}).ok());
}

TEST(RegionRegistry, AnUnregisteredRegionHeldByAnAppendStaysCountedAndMapped) {
  ShmObject obj(4096);
  std::memset(obj.data(), 0x42, 4096);
  RegionRegistry r(Allowed(/*max_regions=*/1));
  ASSERT_TRUE(r.RegisterShm("a", {.shm_name = obj.name()}).ok());
  RegionHold hold;
  LayerRows out;
  LayerRowsRequest in{.ckv_ref = RegionRef{"a", 0, 0}, .kpe_ref = RegionRef{"a", 2048, 0}};
  ASSERT_TRUE(r.ResolveRows([] { return std::string("s"); }, in, 1, Device::Cpu(), &out, &hold).ok());
  absl::StatusOr<uint32_t> holders = r.Unregister("a");
  ASSERT_TRUE(holders.ok());
  EXPECT_EQ(*holders, 1u);
  Drain(r);
  EXPECT_EQ(r.alive(), 1u);  // still held, still counted
  EXPECT_EQ(r.RegisterShm("b", {.shm_name = obj.name()}).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(static_cast<const uint8_t*>(out.source.ckv)[0], 0x42);  // still mapped
  hold = RegionHold{};
  EXPECT_EQ(r.alive(), 0u);
}

TEST(RegionRegistry, ReferencesResolveToPackedHostRows) {
  ShmObject obj(8 * 1152);
  for (int i = 0; i < 8 * 1152; ++i) obj.data()[i] = static_cast<uint8_t>(i % 251);
  RegionRegistry r(Allowed());
  ASSERT_TRUE(r.RegisterShm("rows", {.shm_name = obj.name()}).ok());
  RegionHold hold;
  LayerRows out;
  // Interleaved rows (ckv then kpe, 1152 bytes a row): gathered into packed copies.
  LayerRowsRequest in{.layer = 3, .ckv_ref = RegionRef{"rows", 0, 1152}, .kpe_ref = RegionRef{"rows", 1024, 1152}};
  ASSERT_TRUE(r.ResolveRows([] { return std::string("s"); }, in, 8, Device::Cpu(), &out, &hold).ok());
  EXPECT_EQ(out.layer, 3);
  EXPECT_EQ(out.ckv_bytes, 8u * 1024);
  EXPECT_EQ(out.kpe_bytes, 8u * 128);
  EXPECT_FALSE(out.source.on_device());
  EXPECT_EQ(hold.gathered.size(), 2u);
  const auto* ckv = static_cast<const uint8_t*>(out.source.ckv);
  const auto* kpe = static_cast<const uint8_t*>(out.source.kpe);
  EXPECT_EQ(std::memcmp(ckv + 5 * 1024, obj.data() + 5 * 1152, 1024), 0);
  EXPECT_EQ(std::memcmp(kpe + 5 * 128, obj.data() + 5 * 1152 + 1024, 128), 0);
}

TEST(RegionRegistry, BadReferencesSayWhatIsWrong) {
  ShmObject obj(4096);
  RegionRegistry r(Allowed());
  ASSERT_TRUE(r.RegisterShm("a", {.shm_name = obj.name()}).ok());
  RegionHold hold;
  LayerRows out;
  auto code = [&](LayerRowsRequest in, uint32_t rows) {
    return r.ResolveRows([] { return std::string("sequence 's' layer 0"); }, in, rows, Device::Cpu(), &out, &hold).code();
  };
  EXPECT_EQ(code({.ckv_ref = RegionRef{"missing"}}, 1), absl::StatusCode::kNotFound);
  EXPECT_EQ(code({.ckv_ref = RegionRef{"a", 0, 1000}}, 2), absl::StatusCode::kInvalidArgument);  // stride < row
  EXPECT_EQ(code({.ckv_ref = RegionRef{"a", 0, 1025}}, 2), absl::StatusCode::kInvalidArgument);  // odd stride
  EXPECT_EQ(code({.ckv_ref = RegionRef{"a", 3073, 0}}, 1), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(code({.ckv_ref = RegionRef{"a", 0, 0}}, 5), absl::StatusCode::kOutOfRange);  // 5 x 1024 > 4096
  EXPECT_EQ(code({.ckv = "xx", .ckv_ref = RegionRef{"a"}}, 1), absl::StatusCode::kInvalidArgument);
  const std::string long_name(300, 'r');
  EXPECT_EQ(code({.ckv_ref = RegionRef{long_name}}, 1), absl::StatusCode::kInvalidArgument);
}

TEST(RegionRegistry, APoisonedRegionIsRefusedUntilRegisteredAgain) {
  ShmObject obj(4 * 4096);
  RegionRegistry r(Allowed());
  ASSERT_TRUE(r.RegisterShm("a", {.shm_name = obj.name()}).ok());
  RegionHold hold;
  LayerRows out;
  LayerRowsRequest in{.ckv_ref = RegionRef{"a", 0, 0}, .kpe_ref = RegionRef{"a", 8192, 0}};
  ASSERT_TRUE(r.ResolveRows([] { return std::string("s"); }, in, 8, Device::Cpu(), &out, &hold).ok());
  const int fd = shm_open(obj.name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  volatile uint8_t c = static_cast<const uint8_t*>(out.source.kpe)[0];  // page 2: past the end now
  (void)c;
  EXPECT_EQ(hold.CheckNoFaults("s").code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_EQ(ftruncate(fd, 4 * 4096), 0);
  close(fd);
  RegionHold again;
  const absl::Status refused = r.ResolveRows([] { return std::string("s"); }, in, 8, Device::Cpu(), &out, &again);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "register it again")) << refused;
  ASSERT_TRUE(r.Unregister("a").ok());
  ASSERT_TRUE(r.RegisterShm("a", {.shm_name = obj.name()}).ok());
  RegionHold fresh;
  EXPECT_TRUE(r.ResolveRows([] { return std::string("s"); }, in, 8, Device::Cpu(), &out, &fresh).ok());
}

}  // namespace
}  // namespace mlakv::server
