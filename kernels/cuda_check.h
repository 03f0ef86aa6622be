// CUDA error -> absl::Status with context ("cudaMalloc of 2147483648 bytes on
// cuda:0: out of memory"). For host code that calls the CUDA runtime.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace mlakv {

inline absl::Status CudaStatus(cudaError_t err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  int device = -1;
  cudaGetDevice(&device);
  const std::string msg = absl::StrCat(what, " on cuda:", device, ": ", cudaGetErrorString(err), " (",
                                       cudaGetErrorName(err), ")");
  switch (err) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
      return absl::InvalidArgumentError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return absl::FailedPreconditionError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace mlakv

#define MLAKV_CUDA_RETURN_IF_ERROR(expr, what)                              \
  do {                                                                      \
    if (absl::Status _s = ::mlakv::CudaStatus((expr), (what)); !_s.ok()) { \
      return _s;                                                            \
    }                                                                       \
  } while (0)
