// RegionRegistry: the regions (host shared memory, CUDA IPC allocations) that
// producers on this host registered by name, and the resolution of an
// append's RegionRefs into the row views Pool::Stage takes
// (docs/server.md "Regions").
//
// Every call is refused with PERMISSION_DENIED unless the server runs with
// --allow_ipc. Regions are shared: Unregister drops the registry's reference
// and the name at once, appends in flight keep theirs (RegionHold) and the
// memory is released (munmap, cudaIpcCloseMemHandle) when the last one ends.
//
// Bounded: at most max_regions regions exist at once and max_region_bytes
// are registered over all of them, counting regions that are unregistered
// but still held by an append (each holds a descriptor or a CUDA mapping
// until released). Opening a region (shm_open, mmap, cudaIpcOpenMemHandle)
// may take time, so the service runs Register* and the releases that
// Unregister triggers on worker() rather than on a gRPC thread.
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "mlakv/v1/kv_cache.pb.h"
#include "server/pool.h"
#include "server/region.h"
#include "server/serial_executor.h"

namespace mlakv::server {

// What keeps the rows of an append valid while it is in flight: the regions
// it named and the packed copies of strided host rows.
struct RegionHold {
  std::vector<std::shared_ptr<const Region>> regions;
  std::vector<std::unique_ptr<std::string>> gathered;

  // FAILED_PRECONDITION when a read of a held region faulted (its
  // shared-memory object shrank under the read): the rows read are garbage
  // and the append must be rolled back. `who` starts the message.
  absl::Status CheckNoFaults(const std::string& who) const;
};

class RegionRegistry {
 public:
  struct Options {
    bool allow_ipc = false;  // --allow_ipc: without it every call is PERMISSION_DENIED
    uint32_t max_regions = 256;            // regions alive at once (registered or still held)
    uint64_t max_region_bytes = 1ull << 40;  // bytes of all alive regions together
  };

  explicit RegionRegistry(Options options);
  ~RegionRegistry();

  // Where registrations and region releases run (not a gRPC thread).
  SerialExecutor& worker() { return *worker_; }

  bool allow_ipc() const { return options_.allow_ipc; }
  // PERMISSION_DENIED naming `what` and the flag unless --allow_ipc.
  absl::Status CheckAllowed(const char* what) const;

  // Maps the shared-memory object; ALREADY_EXISTS for a name in use.
  absl::StatusOr<v1::Region> RegisterShm(const v1::RegisterShmRegionRequest& req);
  // Opens the cudaIpcMemHandle_t (64 bytes, else INVALID_ARGUMENT).
  absl::StatusOr<v1::Region> RegisterCuda(const v1::RegisterCudaRegionRequest& req);
  // Forgets `name` (NOT_FOUND if unknown); returns how many appends in flight still hold it.
  absl::StatusOr<uint32_t> Unregister(const std::string& name);
  absl::StatusOr<std::vector<v1::Region>> List() const;
  // Drops every region (shutdown); appends still holding one keep it.
  void Clear();
  // Regions registered now (metrics; no permission check).
  size_t size() const;
  // Regions alive (registered, or unregistered and still held) and their bytes.
  uint32_t alive() const { return accounting_->regions.load(); }
  uint64_t alive_bytes() const { return accounting_->bytes.load(); }

  // Fills out->ckv / out->kpe from `in`: its bytes, or the rows its
  // ckv_ref / kpe_ref name (`row_count` rows of 2-byte elements). Host rows
  // are viewed in place when packed and copied into `hold` when strided.
  // `pool_device` is the appending pool's device ("cpu" or "cuda:N").
  // `who` starts error messages ("sequence 's' layer 0").
  absl::Status ResolveRows(const std::string& who, const v1::LayerRows& in, uint32_t row_count,
                           const std::string& pool_device, LayerRowsIn* out, RegionHold* hold) const;

 private:
  // What every region alive counts against the limits; shared with the
  // regions' deleters, which may run after the registry is gone.
  struct Accounting {
    std::atomic<uint32_t> regions{0};
    std::atomic<uint64_t> bytes{0};
  };
  absl::Status CheckNewName(const std::string& name) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED when one more region of `bytes` would pass a limit;
  // else counts it (Adopt's deleter uncounts it).
  absl::Status Admit(const std::string& name, uint64_t bytes);
  std::shared_ptr<const Region> Adopt(std::unique_ptr<Region> region, uint64_t bytes);
  v1::Region ToProto(const std::string& name, const Region& region, long use_count) const;
  absl::StatusOr<std::string_view> ResolveOne(const std::string& who, const char* field, const v1::RegionRef& ref,
                                              uint64_t row_bytes, uint32_t row_count, const std::string& pool_device,
                                              RegionHold* hold, int64_t* device_stride,
                                              const void** device_events) const;

  const Options options_;
  const std::shared_ptr<Accounting> accounting_ = std::make_shared<Accounting>();
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const Region>> regions_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<SerialExecutor> worker_;  // last: drained first
};

}  // namespace mlakv::server
