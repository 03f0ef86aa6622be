// Device: "cpu" / "cuda:N" parsed once into a value.
#include "server/backend/device.h"

#include <gtest/gtest.h>

namespace mlakv::server {
namespace {

TEST(Device, ParsesCpuAndCudaOrdinals) {
  EXPECT_EQ(*Device::Parse("cpu"), Device::Cpu());
  EXPECT_EQ(Device::Parse("cuda:0")->ordinal(), 0);
  EXPECT_EQ(Device::Parse("cuda:12")->ordinal(), 12);
  EXPECT_TRUE(Device::Parse("cuda:3")->is_cuda());
  EXPECT_FALSE(Device::Cpu().is_cuda());
  EXPECT_EQ(Device::Cuda(7).ToString(), "cuda:7");
  EXPECT_EQ(Device::Cpu().ToString(), "cpu");
}

TEST(Device, AutoIsCpuOrCuda0) {
  absl::StatusOr<Device> d = Device::Parse("auto");
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(*d == Device::Cpu() || *d == Device::Cuda(0));
}

TEST(Device, EveryOtherSpellingIsInvalidArgument) {
  for (const char* bad : {"", "gpu", "cuda", "cuda:", "cuda: 1", "cuda:+1", "cuda:-1", "cuda:1x", "CUDA:0",
                          "cuda:12345678", "cpu "}) {
    absl::StatusOr<Device> d = Device::Parse(bad);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(Device, CpuAlwaysExists) { EXPECT_TRUE(Device::Cpu().CheckExists().ok()); }

TEST(Device, AGpuBeyondTheVisibleOnesDoesNotExist) {
  const absl::Status s = Device::Cuda(4096).CheckExists();
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(s.code() == absl::StatusCode::kFailedPrecondition || s.code() == absl::StatusCode::kInvalidArgument)
      << s;
}

}  // namespace
}  // namespace mlakv::server
