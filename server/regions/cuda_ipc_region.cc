#include "server/regions/cuda_ipc_region.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_check.h"
#include "kernels/scoped_cuda_device.h"

namespace mlakv::server {
namespace {

// cuMemGetAddressRange (CUDA 12 ABI): base and size of the allocation that
// holds `ptr`. Reached through the runtime so the server needs no libcuda at
// link time (it is there at run time wherever a GPU is).
using CuMemGetAddressRangeFn = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);

absl::StatusOr<uint64_t> AllocationBytes(const void* ptr) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult query{};
  cudaError_t err = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &query);
  if (err != cudaSuccess || fn == nullptr || query != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return absl::InternalError("cannot reach cuMemGetAddressRange through cudaGetDriverEntryPointByVersion");
  }
  unsigned long long base = 0;
  size_t size = 0;
  const int rc = reinterpret_cast<CuMemGetAddressRangeFn>(fn)(&base, &size, reinterpret_cast<unsigned long long>(ptr));
  if (rc != 0) return absl::InternalError(absl::StrCat("cuMemGetAddressRange failed with CUresult ", rc));
  // The opened pointer is the allocation's base, so the region spans from base.
  return static_cast<uint64_t>(size) - (reinterpret_cast<unsigned long long>(ptr) - base);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaIpcRegion>> CudaIpcRegion::Create(const Options& options) {
  if (options.raw_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat("raw_handle has ", options.raw_handle.size(),
                                                   " bytes; a cudaIpcMemHandle_t has ", sizeof(cudaIpcMemHandle_t)));
  }
  if (!options.raw_event_handle.empty() && options.raw_event_handle.size() != sizeof(cudaIpcEventHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat("raw_event_handle has ", options.raw_event_handle.size(),
                                                   " bytes; a cudaIpcEventHandle_t has ",
                                                   sizeof(cudaIpcEventHandle_t), " (or leave it empty)"));
  }
  if (options.byte_size == 0) return absl::InvalidArgumentError("byte_size is 0");
  int count = 0;
  if (cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA device is visible to the server (", err == cudaSuccess ? "0 devices" : cudaGetErrorString(err),
        "); register a shared-memory region instead"));
  }
  if (options.device_id < 0 || options.device_id >= count) {
    return absl::InvalidArgumentError(absl::StrCat("device_id ", options.device_id, " does not exist; ", count,
                                                   " CUDA device(s) visible"));
  }
  ScopedCudaDevice scoped(options.device_id);
  if (!scoped.status().ok()) return scoped.status();
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, options.raw_handle.data(), sizeof(handle));
  void* ptr = nullptr;
  if (cudaError_t err = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess); err != cudaSuccess) {
    cudaGetLastError();  // not sticky; leave the context clean for the next call
    return absl::InvalidArgumentError(absl::StrCat(
        "cudaIpcOpenMemHandle on cuda:", options.device_id, " refused the handle: ", cudaGetErrorString(err), " (",
        cudaGetErrorName(err), "); pass the 64 bytes of cudaIpcGetMemHandle from another process, while its "
        "allocation is alive"));
  }
  absl::StatusOr<uint64_t> allocation = AllocationBytes(ptr);
  if (!allocation.ok() || options.byte_size > *allocation) {
    cudaIpcCloseMemHandle(ptr);
    if (!allocation.ok()) return allocation.status();
    return absl::OutOfRangeError(absl::StrCat("byte_size ", options.byte_size, " exceeds the allocation of ",
                                              *allocation, " bytes behind the handle"));
  }
  cudaEvent_t event = nullptr;
  if (!options.raw_event_handle.empty()) {
    cudaIpcEventHandle_t eh;
    std::memcpy(&eh, options.raw_event_handle.data(), sizeof(eh));
    if (cudaError_t err = cudaIpcOpenEventHandle(&event, eh); err != cudaSuccess) {
      cudaGetLastError();
      cudaIpcCloseMemHandle(ptr);
      return absl::InvalidArgumentError(absl::StrCat("cudaIpcOpenEventHandle on cuda:", options.device_id,
                                                     " refused the event handle: ", cudaGetErrorString(err)));
    }
  }
  return std::unique_ptr<CudaIpcRegion>(new CudaIpcRegion(options.raw_handle, options.device_id,
                                                          static_cast<uint8_t*>(ptr), options.byte_size, *allocation,
                                                          event));
}

absl::StatusOr<const uint8_t*> CudaIpcRegion::DataOn(int device) const {
  if (device == device_) return base_;
  absl::MutexLock lock(&mu_);
  if (auto it = peer_mappings_.find(device); it != peer_mappings_.end()) return it->second;
  const std::string both = absl::StrCat("the region is on cuda:", device_, " and the pool on cuda:", device);
  int can_access = 0;
  if (cudaError_t err = cudaDeviceCanAccessPeer(&can_access, device, device_); err != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat(both, ": cudaDeviceCanAccessPeer failed: ", cudaGetErrorString(err)));
  }
  if (can_access == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        both, ", and cuda:", device, " cannot access cuda:", device_,
        "'s memory (cudaDeviceCanAccessPeer: no peer access between these GPUs); register rows on cuda:", device,
        ", or send them as bytes or through a shared-memory region"));
  }
  ScopedCudaDevice scoped(device);
  if (!scoped.status().ok()) return scoped.status();
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, raw_handle_.data(), sizeof(handle));
  void* ptr = nullptr;
  if (cudaError_t err = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess); err != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(both, ": cudaIpcOpenMemHandle with cuda:", device,
                                                      " current (peer access) failed: ", cudaGetErrorString(err), " (",
                                                      cudaGetErrorName(err), ")"));
  }
  peer_mappings_.emplace(device, static_cast<uint8_t*>(ptr));
  return static_cast<const uint8_t*>(ptr);
}

CudaIpcRegion::~CudaIpcRegion() {
  {
    absl::MutexLock lock(&mu_);
    for (auto [device, ptr] : peer_mappings_) {
      ScopedCudaDevice scoped(device);
      cudaIpcCloseMemHandle(ptr);
    }
  }
  ScopedCudaDevice scoped(device_);
  if (event_ != nullptr) cudaEventDestroy(event_);
  cudaIpcCloseMemHandle(base_);
}

std::string CudaIpcRegion::Describe() const {
  std::string peers;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [device, ptr] : peer_mappings_) absl::StrAppend(&peers, peers.empty() ? "" : ",", "cuda:", device);
  }
  if (!peers.empty()) peers = absl::StrCat(" (also opened on ", peers, ")");
  return absl::StrCat("cuda:", device_, " bytes ", byte_size_, " of an allocation of ", allocation_bytes_,
                      event_ != nullptr ? " with event" : "", peers);
}

}  // namespace mlakv::server
