// CudaIpcRegion: a CUDA allocation of another process on this host, opened
// from the cudaIpcMemHandle_t its owner exported (cudaIpcGetMemHandle).
//
// Create opens the handle once (cudaIpcOpenMemHandle with the allocation's
// device current, the caller's device restored), checks byte_size against
// the real allocation (cuMemGetAddressRange, reached through the runtime's
// cudaGetDriverEntryPointByVersion so no libcuda link is needed), and opens
// the optional cudaIpcEventHandle_t. The destructor closes both (with the
// device current), i.e. when the registry and every append holding the
// region have let go. A handle opened in this process stays valid if the
// producer exits, but its contents are then undefined.
//
// A pool on another GPU of the host reads the region through DataOn(its
// device): the handle is opened a second time, with that device current and
// cudaIpcMemLazyEnablePeerAccess, once per device, after
// cudaDeviceCanAccessPeer said that device can reach the region's
// (docs/server.md "Multiple GPUs"); those mappings are closed with the
// region, each with its device current.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/regions/region.h"

typedef struct CUevent_st* cudaEvent_t;

namespace mlakv::server {

class CudaIpcRegion final : public Region {
 public:
  struct Options {
    std::string raw_handle;        // the 64 bytes of a cudaIpcMemHandle_t
    int device_id = 0;             // device the allocation lives on (server's numbering)
    uint64_t byte_size = 0;        // bytes addressed from the handle's base pointer, >= 1
    std::string raw_event_handle;  // empty, or the 64 bytes of a cudaIpcEventHandle_t
  };

  // INVALID_ARGUMENT for wrong handle sizes, a device that does not exist or
  // a handle CUDA refuses (garbage, or exported by this very process);
  // OUT_OF_RANGE when byte_size exceeds the allocation; FAILED_PRECONDITION
  // without a CUDA device.
  static absl::StatusOr<std::unique_ptr<CudaIpcRegion>> Create(const Options& options);
  ~CudaIpcRegion() override;

  Kind kind() const override { return Kind::kCuda; }
  uint64_t byte_size() const override { return byte_size_; }
  const uint8_t* data() const override { return base_; }
  int device() const override { return device_; }
  std::string Describe() const override;

  // The region's first byte as a pointer that kernels and copies on
  // cuda:`device` may read: data() for the region's own device, else the
  // handle opened on `device` (opened on first use, then kept). Thread-safe.
  // FAILED_PRECONDITION, naming both devices, when `device` cannot access
  // the region's device (no peer access between them) or CUDA refuses the
  // second open.
  absl::StatusOr<const uint8_t*> DataOn(int device) const;

  // The producer's event to wait on before reading, or null.
  cudaEvent_t event() const { return event_; }
  // Bytes of the whole allocation behind the handle.
  uint64_t allocation_bytes() const { return allocation_bytes_; }

 private:
  CudaIpcRegion(std::string raw_handle, int device, uint8_t* base, uint64_t byte_size, uint64_t allocation_bytes,
                cudaEvent_t event)
      : raw_handle_(std::move(raw_handle)),
        device_(device),
        base_(base),
        byte_size_(byte_size),
        allocation_bytes_(allocation_bytes),
        event_(event) {}

  const std::string raw_handle_;  // kept to open the handle on other devices
  const int device_;
  uint8_t* const base_;  // device pointer from cudaIpcOpenMemHandle on device_
  const uint64_t byte_size_;
  const uint64_t allocation_bytes_;
  cudaEvent_t const event_;
  mutable absl::Mutex mu_;
  // Other devices the handle was opened on -> the pointer there.
  mutable std::map<int, uint8_t*> peer_mappings_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mlakv::server
