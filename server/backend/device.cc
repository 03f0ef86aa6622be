#include "server/backend/device.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {
namespace {

int VisibleCudaDevices(cudaError_t* err) {
  int count = 0;
  *err = cudaGetDeviceCount(&count);
  if (*err != cudaSuccess) {
    cudaGetLastError();  // not sticky; later calls start clean
    return 0;
  }
  return count;
}

}  // namespace

absl::StatusOr<Device> Device::Parse(absl::string_view text) {
  if (text == "cpu") return Cpu();
  if (text == "auto") {
    cudaError_t err;
    return VisibleCudaDevices(&err) > 0 ? Cuda(0) : Cpu();
  }
  if (absl::StartsWith(text, "cuda:")) {
    const absl::string_view digits = text.substr(5);
    int ordinal = -1;
    if (!digits.empty() && digits.size() <= 6 && std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit) &&
        absl::SimpleAtoi(digits, &ordinal)) {
      return Cuda(ordinal);
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device ", Quote(text), " is not one of auto, cpu, cuda:N (N = GPU index, e.g. cuda:0)"));
}

std::string Device::ToString() const { return is_cuda() ? absl::StrCat("cuda:", ordinal_) : "cpu"; }

absl::Status Device::CheckExists() const {
  if (!is_cuda()) return absl::OkStatus();
  cudaError_t err;
  const int count = VisibleCudaDevices(&err);
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string env = visible == nullptr ? "" : absl::StrCat(" (CUDA_VISIBLE_DEVICES=", visible, ")");
  if (count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("device ", ToString(), " requested but no CUDA device is visible", env, " (",
                     err == cudaSuccess ? "0 devices" : cudaGetErrorString(err), "); use --device=cpu"));
  }
  if (ordinal_ >= count) {
    return absl::InvalidArgumentError(absl::StrCat("device ", ToString(), " does not exist: this server sees ", count,
                                                   " CUDA device(s)", env, ", ",
                                                   count == 1 ? "cuda:0" : absl::StrCat("cuda:0 .. cuda:", count - 1)));
  }
  return absl::OkStatus();
}

void Device::BindThread() const {
  if (!is_cuda()) return;
  if (cudaError_t err = cudaSetDevice(ordinal_); err != cudaSuccess) {
    cudaGetLastError();
    spdlog::warn("cudaSetDevice({}) on a pool's worker thread failed: {}", ordinal_, cudaGetErrorString(err));
  }
}

}  // namespace mlakv::server
