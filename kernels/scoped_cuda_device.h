// Makes a CUDA device current for a scope and restores the caller's current
// device on every path (STYLE: never leave a different device current).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda_check.h"

namespace mlakv {

class ScopedCudaDevice {
 public:
  explicit ScopedCudaDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  }
  ~ScopedCudaDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  ScopedCudaDevice(const ScopedCudaDevice&) = delete;
  ScopedCudaDevice& operator=(const ScopedCudaDevice&) = delete;
  // Whether the device could be made current.
  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

}  // namespace mlakv
