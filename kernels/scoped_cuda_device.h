// Makes a CUDA device current for a scope and restores the caller's current
// device on every path (STYLE: never leave a different device current).
//
// One exception, so that no GPU is touched by accident: when the caller's
// device is one this process never initialized (a thread that never chose a
// device reports cuda:0), it is not restored, because cudaSetDevice creates
// that device's primary context (since CUDA 12) -- a server whose pools are
// all on cuda:1 would otherwise hold memory on cuda:0. Such a thread keeps
// the device set here.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda_check.h"

namespace mlakv {

class ScopedCudaDevice {
 public:
  explicit ScopedCudaDevice(int device) : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ == device) return;  // already current: nothing to set or restore
    status_ = CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  }
  ~ScopedCudaDevice() {
    if (previous_ >= 0 && previous_ != device_ && PrimaryContextActive(previous_)) cudaSetDevice(previous_);
  }
  ScopedCudaDevice(const ScopedCudaDevice&) = delete;
  ScopedCudaDevice& operator=(const ScopedCudaDevice&) = delete;
  // Whether the device could be made current.
  const absl::Status& status() const { return status_; }

  // Whether cuda:`device`'s primary context exists in this process
  // (cuDevicePrimaryCtxGetState, reached through the runtime so no libcuda
  // link is needed); true when that cannot be told.
  static bool PrimaryContextActive(int device) {
    using DeviceGetFn = int (*)(int* dev, int ordinal);
    using StateFn = int (*)(int dev, unsigned int* flags, int* active);
    struct Calls {
      DeviceGetFn device_get = nullptr;
      StateFn state = nullptr;
    };
    static const Calls calls = [] {
      Calls c;
      void* get = nullptr;
      void* state = nullptr;
      cudaDriverEntryPointQueryResult q1{}, q2{};
      if (cudaGetDriverEntryPointByVersion("cuDeviceGet", &get, 12000, cudaEnableDefault, &q1) == cudaSuccess &&
          cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &state, 12000, cudaEnableDefault, &q2) ==
              cudaSuccess &&
          q1 == cudaDriverEntryPointSuccess && q2 == cudaDriverEntryPointSuccess && get != nullptr &&
          state != nullptr) {
        c.device_get = reinterpret_cast<DeviceGetFn>(get);
        c.state = reinterpret_cast<StateFn>(state);
      } else {
        cudaGetLastError();
      }
      return c;
    }();
    if (calls.state == nullptr) return true;
    int dev = 0;
    unsigned int flags = 0;
    int active = 1;
    if (calls.device_get(&dev, device) != 0 || calls.state(dev, &flags, &active) != 0) return true;
    return active != 0;
  }

 private:
  const int device_;
  int previous_ = -1;
  absl::Status status_;
};

}  // namespace mlakv
