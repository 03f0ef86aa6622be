// Pool: one device's paged NVFP4 MLA caches for `num_layers` layers, with
// its page allocator, sequence table, per-layer scales and backend.
//
// Threading (docs/server.md "Concurrency"):
//  * `mu_` guards all metadata (allocator, sequences, layer states). It is
//    held only for short, non-blocking sections, never across backend work,
//    and no section scans every sequence (docs/reliability.md).
//  * Cache memory is touched only from the pool's SerialExecutor (`worker()`):
//    Stage / Commit / Abort / ReadRows must be called there. Queries, Free and
//    Truncate take `mu_` only and may run on any thread: Free and Truncate
//    refuse a sequence with an append in flight, and freed pages can only be
//    rewritten by a later task of the same worker.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/tensor_view.h"
#include "server/core/append_transaction.h"
#include "server/backend/cache_backend.h"
#include "server/backend/device.h"
#include "server/backend/rows.h"
#include "server/core/page_allocator.h"
#include "server/core/sequence_table.h"
#include "server/core/serial_executor.h"

namespace mlakv::server {

// Longest sequence id, in bytes, any call accepts.
inline constexpr size_t kMaxSequenceIdBytes = 1024;

// Rows of one sequence inside an append (one Append message, or one entry of
// an AppendBatch).
struct SequenceRowsIn {
  uint32_t start = 0;           // position of the first row, <= each layer's length
  uint32_t row_count = 0;       // rows per layer
  std::vector<LayerRows> layers;  // server/backend/rows.h
  uint32_t reserve_tokens = 0;  // allocate pages for at least this many tokens
  // Apply only if every layer these rows write (none: the sequence's length)
  // holds exactly this many committed tokens; else FAILED_PRECONDITION.
  std::optional<uint32_t> expect_length;
};

struct SequenceSnapshot {
  std::string id;
  std::vector<int32_t> kv_indices;     // every page held, in order
  std::vector<uint32_t> layer_lengths;  // [num_layers]
  uint32_t length = 0;                 // min over layers
  uint32_t last_page_len = 0;          // entries of page (length-1)/page_size filled; 0 when length is 0
  uint32_t page_size = 0;
  uint32_t capacity_tokens = 0;        // pages x page_size
};

struct LayerSnapshot {
  bool scales_set = false;
  bool scales_from_config = false;
  float ckv_scale = 0.0f;
  float kpe_scale = 0.0f;
  uint64_t tokens = 0;  // committed tokens over all sequences
};

struct PoolSnapshot {
  std::string name;
  Device device = Device::Cpu();
  int32_t num_layers = 0;
  int32_t page_size = 0;
  int32_t pages_total = 0;
  int32_t pages_free = 0;
  int32_t pages_used = 0;
  uint32_t sequences = 0;
  uint32_t max_sequences = 0;
  uint64_t cache_bytes = 0;
  std::vector<LayerSnapshot> layers;
};

struct PageSnapshot {
  int32_t page = 0;
  bool used = false;
  std::string sequence;  // owner; empty when free
  uint32_t page_index = 0;
  uint32_t first_position = 0;
  std::vector<uint32_t> filled_per_layer;
};

struct SequenceListing {
  struct Entry {
    std::string id;
    uint32_t length = 0;
    uint32_t pages = 0;
  };
  std::vector<Entry> sequences;
  std::string next_page_token;  // empty when complete
  uint32_t total = 0;
};

class Pool {
 public:
  struct Options {
    std::string name;        // unique in the server
    Device device = Device::Cpu();
    int32_t num_layers = 0;  // >= 1
    int32_t page_size = 0;   // tokens per page, >= 1
    int32_t num_pages = 0;   // pages, >= 1; num_pages x page_size < 2^31
    // Scales fixed by configuration, per layer ([num_layers] or empty); an
    // unset entry is set by the first append that names scales.
    struct Scales {
      float ckv_scale = 0.0f;  // positive normal float32
      float kpe_scale = 0.0f;
    };
    std::vector<std::optional<Scales>> layer_scales;
    // Sequences not used (appended, read, truncated, queried by id) for this
    // long are freed by FreeIdle; zero keeps them until freed.
    absl::Duration idle_ttl = absl::ZeroDuration();
    // Most sequences the pool holds at once, appends in flight that create
    // one included; a new id beyond it is RESOURCE_EXHAUSTED. >= 1.
    uint32_t max_sequences = 1u << 20;
    // ---- operations: wraps the backend once created (metrics' kernel timing,
    // InstrumentedBackend); null leaves it as is.
    std::function<std::unique_ptr<CacheBackend>(std::unique_ptr<CacheBackend>)> wrap_backend;
  };

  // Allocates the caches on the device (zeroed).
  static absl::StatusOr<std::unique_ptr<Pool>> Create(const Options& options);
  ~Pool();

  const std::string& name() const { return options_.name; }
  const Device& device() const { return device_; }
  int32_t num_layers() const { return options_.num_layers; }
  int32_t page_size() const { return options_.page_size; }
  int32_t num_pages() const { return options_.num_pages; }
  SerialExecutor& worker() { return *worker_; }

  // ---- appends (Stage / Commit / Abort on worker()) ------------------------

  // Holds `sequence` for an append, creating it (invisible until commit) if
  // new. INVALID_ARGUMENT for an empty or over-long id, ABORTED when another
  // append to it is in flight, RESOURCE_EXHAUSTED when a new id would exceed
  // max_sequences.
  absl::StatusOr<std::unique_ptr<AppendTransaction>> BeginAppend(const std::string& sequence);
  // Validates rows for one or more transactions (one per sequence), allocates
  // the pages they reach, saves bytes they will rewrite, then quantizes them
  // into the caches, one backend call for all. Checks run in this order and
  // nothing is allocated or written unless all pass: the shape of every
  // row set (INVALID_ARGUMENT / OUT_OF_RANGE), the state it meets (holes,
  // scales, expect_length: OUT_OF_RANGE / FAILED_PRECONDITION), then
  // capacity (RESOURCE_EXHAUSTED). On any error the caller must Abort every
  // transaction passed. `dtype` may be unset only if no rows come.
  absl::Status Stage(std::span<AppendTransaction* const> txns, std::span<const SequenceRowsIn* const> rows,
                     std::optional<DType> dtype);
  // Advances the lengths; the sequence is visible and free for the next
  // append. A sequence the append created that holds no page and no token
  // is not kept (the snapshot then describes it empty).
  SequenceSnapshot Commit(AppendTransaction& txn);
  // Restores rewritten rows, returns the pages the append allocated, erases a
  // sequence it created, unsets scales it set on a layer that stays empty.
  void Abort(AppendTransaction& txn);

  // ---- queries and releases (any thread) ----------------------------------

  PoolSnapshot Snapshot() const;
  absl::StatusOr<SequenceSnapshot> GetSequence(const std::string& id);
  // `limit` in [1, 1000]; `page_token` is the last id of the previous page.
  SequenceListing ListSequences(size_t limit, const std::string& page_token) const;
  absl::StatusOr<PageSnapshot> GetPage(int64_t page) const;
  // Returns the number of pages freed.
  absl::StatusOr<uint32_t> FreeSequence(const std::string& id);
  // A sequence cut to 0 tokens holds nothing and is removed, as by FreeSequence.
  absl::StatusOr<SequenceSnapshot> TruncateSequence(const std::string& id, uint32_t length);

  // ---- reads (ReadRows on worker()) ---------------------------------------

  // Checks a read of [start, start + count) of `layers` (empty: all; a layer
  // named twice is INVALID_ARGUMENT) and resolves count 0 to "up to the
  // shortest requested layer". Returns the layers to read and sets *count.
  absl::StatusOr<std::vector<int32_t>> PlanRead(const std::string& id, std::span<const uint32_t> layers, uint32_t start,
                                                uint32_t* count);
  // Copies the stored bytes of [start, start + count) of one layer into
  // `out` ([count, 256] / [count, 32] / [count, 64]) and reports the layer's
  // scales. Fails if the sequence was freed or cut below the range meanwhile.
  absl::Status ReadRows(const std::string& id, int32_t layer, uint32_t start, uint32_t count, const EntryRows& out,
                        LayerSnapshot* layer_state) const;

  // Frees committed sequences without an append in flight that were last
  // used before now - idle_ttl (nothing when idle_ttl is zero), least
  // recently used first, at most `max_batch` per hold of the lock (the
  // sequences' storage is destroyed after the lock is released, and the
  // reaper yields between batches), so appends are not held up. Returns
  // how many were freed and logs one line per call. KvCacheServer calls it
  // periodically.
  int FreeIdle(absl::Time now, int max_batch = 128);
  absl::Duration idle_ttl() const { return options_.idle_ttl; }

  // ExportPool: the caches' CUDA IPC handles (FAILED_PRECONDITION on cpu). Any thread.
  absl::StatusOr<std::vector<CacheBackend::LayerHandles>> ExportHandles() const { return backend_->ExportHandles(); }

  // Checks free + used == total, that every used page has exactly one owner
  // whose page table names it, the per-layer token counts, the sequence
  // count, that no committed sequence is empty, and that the use-order list
  // holds exactly the idle committed sequences, oldest first (tests call
  // this after every step; it scans everything).
  absl::Status CheckInvariants() const;

 private:
  // A layer's state: what Snapshot reports (LayerSnapshot, copied as is),
  // plus what only the pool needs.
  struct LayerState : LayerSnapshot {
    int32_t staged_users = 0;  // in-flight appends with rows staged in this layer
  };
  struct StagePlan;

  Pool(const Options& options, std::unique_ptr<CacheBackend> backend,
       std::unique_ptr<PageAllocator> allocator);
  friend class AppendTransaction;

  // ---- the steps of Stage ----
  // Shape of one sequence's rows; needs no state.
  absl::Status ValidateShape(const std::string& who, const SequenceRowsIn& rows, std::optional<DType> dtype) const;
  // Against the pool's state: scales, holes, expect_length; records scales
  // to set and pages to allocate in `plan`.
  absl::Status CheckState(size_t index, const AppendTransaction& txn, const SequenceRowsIn& rows, StagePlan& plan) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status CheckCapacity(const StagePlan& plan) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Allocates the planned pages and sets the planned scales (cannot fail
  // after CheckCapacity).
  void Reserve(std::span<AppendTransaction* const> txns, StagePlan& plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Segments per layer, page tables, and the committed positions to save.
  void PlanWrites(std::span<AppendTransaction* const> txns, std::span<const SequenceRowsIn* const> rows,
                  std::optional<DType> dtype, StagePlan& plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads the bytes the writes will overwrite into the undo logs (backend).
  absl::Status CaptureUndo(const StagePlan& plan);
  void RecordStaged(std::span<AppendTransaction* const> txns, std::span<const SequenceRowsIn* const> rows)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  SequenceSnapshot SnapshotOf(const Sequence& seq) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The committed sequence `id`, or NOT_FOUND naming the pool.
  absl::StatusOr<Sequence*> FindCommitted(const std::string& id) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  int64_t EntryOf(const Sequence& seq, uint32_t position) const;
  void ReleasePages(std::span<const int32_t> pages) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases a committed, idle sequence's pages and tokens and erases it;
  // `storage` (if given) receives the sequence's node to destroy later.
  uint32_t EraseSequence(Sequence* seq, SequencesById::node_type* storage = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const Device device_;
  const int64_t max_tokens_;  // num_pages x page_size
  std::unique_ptr<CacheBackend> backend_;

  mutable absl::Mutex mu_;
  std::unique_ptr<PageAllocator> allocator_ ABSL_GUARDED_BY(mu_);
  SequenceTable sequences_ ABSL_GUARDED_BY(mu_);
  std::vector<LayerState> layers_ ABSL_GUARDED_BY(mu_);

  // Last member: destroyed first, so queued tasks finish while the rest lives.
  std::unique_ptr<SerialExecutor> worker_;
};

}  // namespace mlakv::server
