#include "server/cache_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/cpu_backend.h"
#include "server/cuda_backend.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {

QuantizeAppendParams LayerParams(const LayerAppend& la, const CacheBackend::Geometry& g, uint8_t* ckv, uint8_t* sf,
                                 uint8_t* kpe) {
  QuantizeAppendParams p;
  p.dtype = la.dtype;
  p.ckv_cache = ckv;
  p.ckv_sf_cache = sf;
  p.kpe_cache = kpe;
  p.num_pages = g.num_pages;
  p.page_size = g.page_size;
  p.kv_indices = la.kv_indices.data();
  p.kv_indptr = la.kv_indptr.data();
  p.batch_size = static_cast<int32_t>(la.kv_indptr.size()) - 1;
  p.num_kv_indices = static_cast<int64_t>(la.kv_indices.size());
  p.ckv_scale = la.ckv_scale;
  p.kpe_scale = la.kpe_scale;
  return p;
}

int CudaOrdinal(const std::string& device) {
  if (!absl::StartsWith(device, "cuda:")) return -1;
  const std::string digits = device.substr(5);
  if (digits.empty() || digits.size() > 6 || !std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit)) {
    return -1;
  }
  int ordinal = -1;
  return absl::SimpleAtoi(digits, &ordinal) ? ordinal : -1;
}

absl::Status CheckDeviceExists(const std::string& device) {
  if (absl::Status s = CheckDeviceName(device); !s.ok()) return s;
  if (device == "cpu") return absl::OkStatus();
  const int ordinal = CudaOrdinal(device);
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) cudaGetLastError();  // not sticky; later calls start clean
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string env = visible == nullptr ? "" : absl::StrCat(" (CUDA_VISIBLE_DEVICES=", visible, ")");
  if (err != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("device ", device, " requested but no CUDA device is visible", env, " (",
                     err == cudaSuccess ? "0 devices" : cudaGetErrorString(err), "); use --device=cpu"));
  }
  if (ordinal >= count) {
    return absl::InvalidArgumentError(absl::StrCat("device ", device, " does not exist: this server sees ", count,
                                                   " CUDA device(s)", env, ", ",
                                                   count == 1 ? "cuda:0" : absl::StrCat("cuda:0 .. cuda:", count - 1)));
  }
  return absl::OkStatus();
}

void BindThreadToDevice(const std::string& device) {
  const int ordinal = CudaOrdinal(device);
  if (ordinal < 0) return;
  if (cudaError_t err = cudaSetDevice(ordinal); err != cudaSuccess) {
    cudaGetLastError();
    spdlog::warn("cudaSetDevice({}) on a pool's worker thread failed: {}", ordinal, cudaGetErrorString(err));
  }
}

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
  if (absl::Status s = CheckDeviceExists(device); !s.ok()) return s;
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
