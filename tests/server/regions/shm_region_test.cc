// ShmRegion: what a producer can hand the server by name, and what it cannot
// make the server do (docs/reliability.md "Regions").
#include "server/regions/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "absl/strings/match.h"
#include "tests/testing/shm_object.h"

namespace mlakv::server {
namespace {

using mlakv::testing::ShmObject;

absl::StatusCode CodeOf(const std::string& name) {
  return ShmRegion::Create({.shm_name = name}).status().code();
}

// A name in /dev/shm that the test removes again.
class DevShmEntry {
 public:
  explicit DevShmEntry(const std::string& suffix)
      : name_("/mlakv-test-" + std::to_string(getpid()) + "-" + suffix), path_("/dev/shm" + name_) {}
  ~DevShmEntry() {
    unlink(path_.c_str());
    rmdir(path_.c_str());
  }
  const std::string& name() const { return name_; }
  const std::string& path() const { return path_; }

 private:
  std::string name_, path_;
};

TEST(ShmRegion, MalformedNamesAreInvalidArgument) {
  for (const std::string& name :
       {std::string("x"), std::string("/"), std::string("/a/b"), std::string("/."), std::string("/.."),
        std::string("/a\nb"), std::string("/a\x7f"), std::string("/a\0b", 4), "/" + std::string(255, 'n')}) {
    const absl::Status s = ShmRegion::Create({.shm_name = name}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << name.size() << " " << s;
    EXPECT_FALSE(absl::StrContains(s.message(), "\n")) << s;  // quoted, never raw
  }
}

TEST(ShmRegion, AFifoIsRefusedWithoutBlocking) {
  DevShmEntry fifo("fifo");
  ASSERT_EQ(mkfifo(fifo.path().c_str(), 0600), 0);
  const auto started = std::chrono::steady_clock::now();
  const absl::Status s = ShmRegion::Create({.shm_name = fifo.name()}).status();
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(2));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "a FIFO")) << s;
}

TEST(ShmRegion, ADirectoryIsRefused) {
  DevShmEntry dir("dir");
  ASSERT_EQ(mkdir(dir.path().c_str(), 0700), 0);
  const absl::Status s = ShmRegion::Create({.shm_name = dir.name()}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "a directory")) << s;
}

TEST(ShmRegion, ASymbolicLinkIsNotFollowed) {
  ShmObject target(4096);
  DevShmEntry link("link");
  ASSERT_EQ(symlink(("/dev/shm" + target.name()).c_str(), link.path().c_str()), 0);
  const absl::Status s = ShmRegion::Create({.shm_name = link.name()}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "symbolic link")) << s;
  EXPECT_TRUE(ShmRegion::Create({.shm_name = target.name()}).ok());
}

TEST(ShmRegion, MissingObjectIsNotFound) { EXPECT_EQ(CodeOf("/mlakv-test-does-not-exist"), absl::StatusCode::kNotFound); }

TEST(ShmRegion, RangeOutsideTheObjectIsOutOfRange) {
  ShmObject obj(8192);
  EXPECT_EQ(ShmRegion::Create({.shm_name = obj.name(), .offset = 8192}).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(ShmRegion::Create({.shm_name = obj.name(), .offset = 4096, .byte_size = 4097}).status().code(),
            absl::StatusCode::kOutOfRange);
  auto ok = ShmRegion::Create({.shm_name = obj.name(), .offset = 4096, .byte_size = 4096});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->byte_size(), 4096u);
}

TEST(ShmRegion, AShrinkBeforeAReadIsFailedPreconditionAndDuringItPoisonsTheRegion) {
  ShmObject obj(4 * 4096);
  std::memset(obj.data(), 7, 4 * 4096);
  auto region = ShmRegion::Create({.shm_name = obj.name()});
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_TRUE((*region)->CheckSize().ok());
  const int fd = shm_open(obj.name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  EXPECT_EQ((*region)->CheckSize().code(), absl::StatusCode::kFailedPrecondition);
  // A read that does not look first (the race CheckSize cannot close): zeros, not a crash.
  const volatile uint8_t* data = (*region)->data();
  EXPECT_EQ(data[0], 7);
  EXPECT_EQ(data[3 * 4096], 0);
  EXPECT_TRUE((*region)->faulted());
  // Growing the object back does not heal the region.
  ASSERT_EQ(ftruncate(fd, 4 * 4096), 0);
  close(fd);
  const absl::Status after = (*region)->CheckSize();
  EXPECT_EQ(after.code(), absl::StatusCode::kFailedPrecondition) << after;
  EXPECT_TRUE(absl::StrContains(after.message(), "register it again")) << after;
}

}  // namespace
}  // namespace mlakv::server
