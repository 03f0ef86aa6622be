// Device: where a pool's caches live — the host ("cpu") or one GPU
// ("cuda:N", N the CUDA runtime's ordinal after CUDA_VISIBLE_DEVICES).
//
// Parsed once, from the config or --device, into this value; everything
// after (the pool, its backend and worker, regions, ExportPool, metrics)
// takes the value, never the string again.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mlakv::server {

class Device {
 public:
  static Device Cpu() { return Device(-1); }
  static Device Cuda(int ordinal) { return Device(ordinal); }

  // "cpu" or "cuda:N" (N decimal digits, no sign or spaces); "auto" is
  // cuda:0 when a CUDA device is visible, else cpu. INVALID_ARGUMENT for
  // any other spelling.
  static absl::StatusOr<Device> Parse(absl::string_view text);

  bool is_cuda() const { return ordinal_ >= 0; }
  // N of cuda:N; -1 for cpu.
  int ordinal() const { return ordinal_; }
  // "cpu" or "cuda:N".
  std::string ToString() const;
  bool operator==(const Device& other) const { return ordinal_ == other.ordinal_; }

  // OK for cpu and for a cuda:N this host has: FAILED_PRECONDITION when no
  // CUDA device is visible, INVALID_ARGUMENT naming the devices there are
  // (and CUDA_VISIBLE_DEVICES when set) when N is too large.
  absl::Status CheckExists() const;

  // Makes this device's GPU current on the calling thread (cpu: nothing).
  // Each pool's worker thread calls it once when it starts
  // (docs/server.md "Multiple GPUs"); a failure is logged, and every CUDA
  // entry point sets its device anyway.
  void BindThread() const;

 private:
  explicit Device(int ordinal) : ordinal_(ordinal) {}
  int ordinal_;
};

}  // namespace mlakv::server
