#include "server/cache_backend.h"

#include <cuda_runtime_api.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/cpu_backend.h"
#include "server/cuda_backend.h"

namespace mlakv::server {
namespace {

// N of "cuda:N", or -1 when `device` is not spelled that way.
int CudaOrdinal(const std::string& device) {
  int ordinal = -1;
  if (!absl::StartsWith(device, "cuda:") || !absl::SimpleAtoi(device.substr(5), &ordinal) || ordinal < 0) return -1;
  return ordinal;
}

}  // namespace

std::string ResolveAutoDevice() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return "cpu";
  }
  return count > 0 ? "cuda:0" : "cpu";
}

absl::Status CheckDeviceName(const std::string& device) {
  if (device == "cpu" || CudaOrdinal(device) >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("device '", device, "' is not one of auto, cpu, cuda:N (N = GPU index, e.g. cuda:0)"));
}

absl::StatusOr<std::unique_ptr<CacheBackend>> CreateCacheBackend(const std::string& device,
                                                                 const CacheBackend::Geometry& geometry) {
  if (absl::Status s = CheckDeviceName(device); !s.ok()) return s;
  if (device == "cpu") {
    absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create({.geometry = geometry});
    if (!cpu.ok()) return cpu.status();
    return std::unique_ptr<CacheBackend>(std::move(*cpu));
  }
  absl::StatusOr<std::unique_ptr<CudaBackend>> cuda =
      CudaBackend::Create({.geometry = geometry, .device_ordinal = CudaOrdinal(device)});
  if (!cuda.ok()) return cuda.status();
  return std::unique_ptr<CacheBackend>(std::move(*cuda));
}

}  // namespace mlakv::server
