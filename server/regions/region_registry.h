// RegionRegistry: the regions (host shared memory, CUDA IPC allocations) that
// producers on this host registered by name, and the resolution of an
// append's region references into the rows the Pool takes
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
// Unregister triggers on worker() rather than on a gRPC thread -- except
// that a region an append still holds when it is unregistered is released
// where that append lets it go: its pool's worker, or a completion-queue
// thread when the stream ends (munmap, or cudaIpcCloseMemHandle and
// cudaEventDestroy there; not moved to worker() yet, which would have to
// outlive the registry for holds that do).
// Plain types only (no protobuf): server/rpc converts. Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/backend/device.h"
#include "server/backend/rows.h"
#include "server/core/serial_executor.h"
#include "server/regions/cuda_ipc_region.h"
#include "server/regions/region.h"
#include "server/regions/shm_region.h"

namespace mlakv::server {

// Longest region name.
inline constexpr size_t kMaxRegionNameBytes = 256;

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

// A registered region as listings show it.
struct RegionInfo {
  std::string name;
  Region::Kind kind = Region::Kind::kShm;
  uint64_t byte_size = 0;
  std::string shm_name;   // kShm
  uint64_t shm_offset = 0;  // kShm
  int device = -1;        // kCuda
  bool has_event = false;   // kCuda
  uint32_t appends_in_flight = 0;
};

// Where rows of one tensor lie in a region: row i at offset + i x stride.
struct RegionRef {
  absl::string_view region;
  uint64_t offset = 0;
  uint64_t row_stride_bytes = 0;  // 0: packed rows
};

// One layer's rows as a request names them: bytes, or a reference per tensor.
struct LayerRowsRequest {
  int32_t layer = 0;
  absl::string_view ckv{}, kpe{};  // bytes carried in the message (empty with a reference)
  // Or the bytes in pieces (the message's slices, server/rpc/append_wire.h);
  // then ckv / kpe are empty.
  const BytePieces* ckv_pieces = nullptr;
  const BytePieces* kpe_pieces = nullptr;
  std::optional<RegionRef> ckv_ref{}, kpe_ref{};
  float ckv_scale = 0.0f, kpe_scale = 0.0f;
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
  absl::StatusOr<RegionInfo> RegisterShm(const std::string& name, const ShmRegion::Options& shm);
  // Opens the cudaIpcMemHandle_t (64 bytes, else INVALID_ARGUMENT).
  absl::StatusOr<RegionInfo> RegisterCuda(const std::string& name, const CudaIpcRegion::Options& cuda);
  // Forgets `name` (NOT_FOUND if unknown); returns how many appends in flight still hold it.
  absl::StatusOr<uint32_t> Unregister(const std::string& name);
  // Ordered by name.
  absl::StatusOr<std::vector<RegionInfo>> List() const;
  // Drops every region (shutdown); appends still holding one keep it.
  void Clear();
  // Regions registered now (metrics; no permission check).
  size_t size() const;
  // Regions alive (registered, or unregistered and still held) and their bytes.
  uint32_t alive() const { return accounting_->regions.load(); }
  uint64_t alive_bytes() const { return accounting_->bytes.load(); }

  // `in`'s rows as the Pool takes them: its bytes, or the rows its
  // references name (`row_count` rows of 2-byte elements). Host rows are
  // viewed in place when packed and copied into `hold` when strided.
  // `pool_device` is the appending pool's device. `who` starts error
  // messages ("sequence 's' layer 0"; built only for one).
  absl::Status ResolveRows(absl::FunctionRef<std::string()> who, const LayerRowsRequest& in, uint32_t row_count,
                           const Device& pool_device, LayerRows* out, RegionHold* hold) const;

  // The producers' CUDA events (each once) of the regions `names` name that
  // were registered with one, those regions added to `hold` so that their
  // events outlive a wait on them. Unknown names are skipped: the append's
  // ResolveRows reports them. (An AppendBatch by reference waits for these
  // before it takes the pool's worker: KvCacheService::AppendBatch.)
  std::vector<const void*> EventsOf(std::span<const absl::string_view> names, RegionHold* hold) const;

 private:
  // What every region alive counts against the limits; shared with the
  // regions' deleters, which may run after the registry is gone.
  struct Accounting {
    std::atomic<uint32_t> regions{0};
    std::atomic<uint64_t> bytes{0};
  };
  // One tensor's resolution.
  struct Resolved {
    const void* data = nullptr;
    uint64_t bytes = 0;            // as packed rows
    int64_t device_stride = 0;     // > 0: device memory, rows this far apart
    const void* event = nullptr;   // CUDA region's event
  };

  absl::Status CheckNewName(const std::string& name) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED when one more region of `bytes` would pass a limit;
  // else counts it (Adopt's deleter uncounts it).
  absl::Status Admit(const std::string& name, uint64_t bytes);
  std::shared_ptr<const Region> Adopt(std::unique_ptr<Region> region, uint64_t bytes);
  // Adds the region under `name` (ALREADY_EXISTS if taken meanwhile).
  absl::StatusOr<RegionInfo> Insert(const std::string& name, std::shared_ptr<const Region> region);
  static RegionInfo InfoOf(const std::string& name, const Region& region, long use_count);
  absl::StatusOr<Resolved> ResolveOne(absl::FunctionRef<std::string()> who, const char* field, const RegionRef& ref,
                                      uint64_t row_bytes, uint32_t row_count, const Device& pool_device,
                                      RegionHold* hold) const;

  const Options options_;
  const std::shared_ptr<Accounting> accounting_ = std::make_shared<Accounting>();
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const Region>, std::less<>> regions_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<SerialExecutor> worker_;  // last: drained first
};

}  // namespace mlakv::server
