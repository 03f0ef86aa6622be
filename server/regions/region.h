// Region: memory of another process on this host that appends may read rows
// from instead of carrying bytes (docs/server.md "Regions"). Registered by
// name in the RegionRegistry; shared (std::shared_ptr) between the registry
// and the appends in flight that named it, so the memory stays mapped until
// the last of them lets go, however early it is unregistered.
//
// Implementations: ShmRegion (a POSIX shared-memory object mapped read-only
// into this process) and CudaIpcRegion (a CUDA allocation opened from a
// cudaIpcMemHandle_t).
#pragma once

#include <cstdint>
#include <string>

namespace mlakv::server {

class Region {
 public:
  enum class Kind { kShm, kCuda };

  virtual ~Region() = default;

  virtual Kind kind() const = 0;
  // Bytes addressable by a RegionRef: [0, byte_size).
  virtual uint64_t byte_size() const = 0;
  // kShm: the region's first byte in this process's address space (read
  // only). kCuda: the device pointer of the region's first byte on device().
  virtual const uint8_t* data() const = 0;
  // kCuda: the CUDA device (server's numbering); -1 for kShm.
  virtual int device() const { return -1; }
  // A one-line description for listings and logs.
  virtual std::string Describe() const = 0;
  // True once a read of the region faulted (a shared-memory object shrank
  // under the read, MappingFaultGuard): the rows read were garbage and the
  // region cannot be read again.
  virtual bool faulted() const { return false; }
};

}  // namespace mlakv::server
