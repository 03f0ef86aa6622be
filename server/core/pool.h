// Pool: one device's paged NVFP4 MLA caches for `num_layers` layers, with
// its page allocator, sequence table, per-layer scales and backend.
//
// Threading (docs/server.md "Concurrency"):
//  * `mu_` guards all metadata (allocator, sequences, layer states). It is
//    held only for short, non-blocking sections, never across backend work,
//    and no section scans every sequence (docs/reliability.md).
//  * Cache memory is touched only from the pool's SerialExecutor (`worker()`):
//    Stage / Commit / Abort / ReadRows / Fork must be called there. Queries,
//    Free, Truncate, leases and MatchPrefix take `mu_` only and may run on any
//    thread: Free and Truncate refuse a sequence with an append in flight,
//    and freed pages can only be rewritten by a later task of the same worker.
//
// Cache management (docs/server.md "Leases", "Eviction", "Shared pages"):
//  * every sequence has a generation (server/core/ids.h) that calls may pin;
//  * a lease protects tokens [0, tokens) of one incarnation: a free retains
//    the sequence (out of the table, pages kept) until the last lease ends;
//    truncates and rewrites below `tokens` are refused; reaper and eviction
//    pass leased sequences by;
//  * pages are reference counted (PageAllocator): forks share full pages,
//    copy a partial last one; a write to a shared page copies it first
//    (copy-on-write, undone by Abort like any other write);
//  * complete pages may be indexed by a client's block hash (PrefixIndex).
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
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/tensor_view.h"
#include "server/backend/cache_backend.h"
#include "server/backend/device.h"
#include "server/backend/rows.h"
#include "server/core/append_transaction.h"
#include "server/core/ended_sequences.h"
#include "server/core/kv_events.h"
#include "server/core/lease_table.h"
#include "server/core/page_allocator.h"
#include "server/core/prefix_index.h"
#include "server/core/sequence_table.h"
#include "server/core/serial_executor.h"
#include "server/core/source_waiter.h"

namespace mlakv::server {

// Longest sequence id, in bytes, any call accepts.
inline constexpr size_t kMaxSequenceIdBytes = 1024;
// Longest lease holder name, in bytes.
inline constexpr size_t kMaxLeaseHolderBytes = 256;
// Most block hashes one call may carry.
inline constexpr size_t kMaxBlockHashesPerCall = 65536;

// Which incarnation of a sequence a call means: an id, optionally pinned to
// a generation (else FAILED_PRECONDITION naming both), or (reads) the
// incarnation a lease holds, which outlives a free.
struct SequenceRef {
  SequenceRef() = default;
  SequenceRef(std::string sequence_id) : id(std::move(sequence_id)) {}  // NOLINT: a bare id is the common case
  SequenceRef(const char* sequence_id) : id(sequence_id) {}             // NOLINT
  std::string id;
  std::optional<uint64_t> expect_generation;
  uint64_t lease_id = 0;  // reads only; 0: none
  // The same without the lease (calls that act on the live sequence only).
  SequenceRef ById() const {
    SequenceRef r = *this;
    r.lease_id = 0;
    return r;
  }
};

// Who takes a lease and for how long (zero: the pool's default).
struct LeaseRequest {
  std::string holder;  // 1..kMaxLeaseHolderBytes
  absl::Duration duration = absl::ZeroDuration();
};

struct LeaseSnapshot {
  uint64_t id = 0;
  std::string sequence;  // empty: a page lease
  uint64_t generation = 0;
  std::string holder;
  uint32_t tokens = 0;
  std::vector<int32_t> pages;  // page lease only
  int64_t expire_unix_ms = 0;
  int64_t duration_ms = 0;
  bool sequence_freed = false;
};

// Rows of one sequence inside an append (one Append message, or one entry of
// an AppendBatch).
struct SequenceRowsIn {
  uint32_t start = 0;           // position of the first row, <= each layer's length
  uint32_t row_count = 0;       // rows per layer
  std::vector<LayerRows> layers;  // server/backend/rows.h; this sequence's own rows, or:
  // (AppendBatch's compact form, instead of `layers`) one LayerRows per
  // layer holding the rows of all the call's sequences back to back, the
  // same entries for every sequence of the call (owned by the caller, alive
  // through Stage); this sequence's rows are rows [shared_first,
  // shared_first + row_count) of each. One set of entries per call, rather
  // than one per (sequence, layer), keeps a decode step's host work
  // O(sequences + layers) where it can be.
  std::span<const LayerRows> shared_layers;
  uint64_t shared_first = 0;
  // The layers these rows write.
  std::span<const LayerRows> written_layers() const {
    return shared_layers.empty() ? std::span<const LayerRows>(layers) : shared_layers;
  }
  uint32_t reserve_tokens = 0;  // allocate pages for at least this many tokens
  // Apply only if every layer these rows write (none: the sequence's length)
  // holds exactly this many committed tokens; else FAILED_PRECONDITION.
  std::optional<uint32_t> expect_length;
  // Apply only to this incarnation (NOT_FOUND when the append would create
  // the sequence, FAILED_PRECONDITION when it has another generation).
  std::optional<uint64_t> expect_generation;
  // Block hashes of page-table entries block_hashes_first_page + i
  // (server/core/prefix_index.h), indexed once complete in every layer.
  std::vector<std::string> block_hashes;
  uint32_t block_hashes_first_page = 0;
  // Create the sequence pinned (no effect on an existing one).
  bool pin = false;
};

// How much of the page table a snapshot copies: all of it, the pages the
// append allocated, or none (kv_indices_offset then = the pages held).
enum class SnapshotPages { kAll, kNew, kNone };

struct SequenceSnapshot {
  std::string id;
  // The page table from entry kv_indices_offset on: every page held
  // (offset 0), or after an append committed with SnapshotPages::kNew only
  // the pages it allocated.
  std::vector<int32_t> kv_indices;
  uint32_t kv_indices_offset = 0;
  std::vector<uint32_t> layer_lengths;  // [num_layers]; empty with SnapshotPages::kNew
  uint32_t length = 0;                 // min over layers
  uint32_t last_page_len = 0;          // entries of page (length-1)/page_size filled; 0 when length is 0
  uint32_t page_size = 0;
  uint32_t capacity_tokens = 0;        // pages x page_size
  uint64_t generation = 0;
  uint32_t leases = 0;
  bool pinned = false;
  uint32_t shared_pages = 0;           // entries of kv_indices with more than one reference (0 from appends)
  std::optional<LeaseSnapshot> lease;  // the lease the call took, if any
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
  int32_t pages_shared = 0;
  uint32_t leases = 0;
  uint32_t sequences_retained = 0;
  uint32_t pages_indexed = 0;
  bool eviction_lru = false;
  // The pool's worker (its SerialExecutor): busy time since the pool was
  // created, tasks queued or running now. Left empty by Pool::Snapshot (a
  // GetPool need not take the worker's lock); the metrics' scrape-time
  // source fills it from worker().load().
  SerialExecutor::Load worker;
  // Since the pool was created.
  struct Counters {
    uint64_t evictions = 0;
    uint64_t evicted_pages = 0;
    uint64_t idle_freed = 0;
    uint64_t leases_acquired = 0;
    uint64_t leases_released = 0;
    uint64_t leases_expired = 0;
    uint64_t forks = 0;
    uint64_t fork_pages_shared = 0;
    uint64_t pages_copied = 0;  // partial pages of forks and copy-on-write
    uint64_t prefix_queries = 0;
    uint64_t prefix_hit_pages = 0;
  } counters;
};

struct FreeResult {
  uint32_t pages_freed = 0;     // returned to the free list now
  uint32_t leases = 0;          // leases that retain the sequence
  uint32_t pages_retained = 0;  // pages kept for them
};

struct LeaseListing {
  std::vector<LeaseSnapshot> leases;
  uint64_t next_after = 0;  // 0 when complete
  uint32_t total = 0;
};

struct ForkRequest {
  std::string target{};
  SequenceRef source{};                     // or, with source.id empty:
  std::vector<std::string> block_hashes{};  // a block-hash chain
  uint32_t length = 0;                      // source fork: tokens (0: the source's length)
  bool pin = false;
  // Run right before the target becomes visible, with the pages it will
  // hold (the RPC layer: the call still alive, the response within the send
  // limit); an error there undoes the fork. May be empty.
  std::function<absl::Status(size_t pages)> last_check{};
};

struct ForkResult {
  std::optional<SequenceSnapshot> sequence;  // unset: a hash fork that matched nothing
  uint32_t pages_shared = 0;
  uint32_t pages_copied = 0;
};

struct PrefixMatch {
  uint32_t matched_pages = 0;
  std::vector<int32_t> kv_indices;
  std::optional<LeaseSnapshot> lease;
};

struct PageSnapshot {
  int32_t page = 0;
  bool used = false;
  std::string sequence;  // owner; empty when free
  uint32_t page_index = 0;
  uint32_t first_position = 0;
  std::vector<uint32_t> filled_per_layer;
  int32_t references = 0;
  std::string block_hash;  // empty: not indexed
  bool sequence_freed = false;  // the owner is retained for a lease
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
    // What an append that needs more pages than are free does.
    struct Eviction {
      bool lru = false;  // false: RESOURCE_EXHAUSTED
      // Background eviction from high to low (fractions of pages_total; high 0: off).
      double high_watermark = 0.0;
      double low_watermark = 0.0;
      uint32_t remember_ended = 4096;  // ids remembered as evicted / idle-freed
    } eviction;
    // Leases: in the pool, per sequence, longest and default duration.
    uint32_t max_leases = 65536;
    uint32_t max_leases_per_sequence = 64;
    absl::Duration max_lease_duration = absl::Hours(1);
    absl::Duration default_lease_duration = absl::Seconds(30);
    // The clock of TTLs, leases and eviction records (tests set it); null: absl::Now.
    std::function<absl::Time()> clock;
    // Longest the backend waits for a producer's CUDA event before it reads
    // rows by reference that no one waited for before (a stream's message
    // that rewrites rows; held writes flushed mid-stream): then the write
    // fails, DEADLINE_EXCEEDED, nothing written. The server sets its
    // append_idle_timeout_seconds.
    absl::Duration source_timeout = absl::Seconds(60);
    // Where the pool records its KV events (pages stored / removed,
    // server/core/kv_events.h); not owned, outlives the pool; null: none.
    EventLog* events = nullptr;
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

  // When the producers' `events` (DeferredWrites::WaitEvents) have not all
  // completed: hands `done` to the pool's SourceWaiter (its thread calls it
  // once they have, or with the error, DEADLINE_EXCEEDED at the deadline,
  // CANCELLED once `limits` say the caller abandoned it or when the pool
  // goes) and returns true. Else false, and `done` is not called: the rows
  // can be written now. Any thread.
  bool WhenSourcesComplete(std::vector<const void*> events, WaitLimits limits, SourceWaiter::Done done);
  // On the worker, in a task: waits for `events` here, spinning, while no
  // other task is queued behind the caller -- true once they have completed
  // (the write follows them at once, as a synchronization on the worker
  // would), false as soon as another task is queued (hand the wait to
  // WhenSourcesComplete and return: the worker is the pool's, not the
  // stream's) -- or the query's error, DEADLINE_EXCEEDED at the deadline,
  // CANCELLED once `limits` say the caller abandoned it.
  absl::StatusOr<bool> WaitForSourcesHere(std::span<const void* const> events, const WaitLimits& limits);
  // Whether `events` have all completed, without waiting (one query each).
  absl::StatusOr<bool> SourcesComplete(std::span<const void* const> events);
  size_t sources_waiting() const { return waiter_->waiting(); }

  // ---- appends (Stage / Commit / Abort on worker(); pool_append.cc) -------

  // Holds `sequence` for an append, creating it (invisible until commit) if
  // new. INVALID_ARGUMENT for an empty or over-long id, ABORTED when another
  // append to it is in flight, RESOURCE_EXHAUSTED when a new id would exceed
  // max_sequences.
  absl::StatusOr<std::unique_ptr<AppendTransaction>> BeginAppend(const std::string& sequence);
  // The same for several sequences under one hold of the lock (an
  // AppendBatch), appending to `out` in order; at the first error, `out`
  // holds the transactions begun before it (for the caller to Abort).
  absl::Status BeginAppends(std::span<const std::string* const> sequences,
                            std::vector<std::unique_ptr<AppendTransaction>>* out);
  // Validates rows for one or more transactions (one per sequence), allocates
  // the pages they reach, saves bytes they will rewrite, then quantizes them
  // into the caches, one backend call for all. Checks run in this order and
  // nothing is allocated or written unless all pass: the shape of every
  // row set (INVALID_ARGUMENT / OUT_OF_RANGE), the state it meets (holes,
  // scales, expect_length: OUT_OF_RANGE / FAILED_PRECONDITION), then
  // capacity (RESOURCE_EXHAUSTED). On any error the caller must Abort every
  // transaction passed. `dtype` may be unset only if no rows come.
  //
  // `deferred` (an Append stream's, across its messages): when every layer's
  // rows lie in device memory in one run (ContiguousDeviceRows: the backend
  // reads them in place, nothing but the placement to stage) and the call
  // copies and rewrites nothing, the write is held there instead of handed to
  // the backend, for Flush to write with the others in one backend call.
  // Held writes are flushed first before a write that cannot be held or that
  // names a layer held already, so the caches see the writes in Stage order.
  // The rows must stay readable until the flush (the stream holds its
  // regions until it ends).
  class DeferredWrites;
  struct StagePlan;  // what one Stage checks, reserves and writes (pool.cc)
  absl::Status Stage(std::span<AppendTransaction* const> txns, std::span<const SequenceRowsIn* const> rows,
                     std::optional<DType> dtype, DeferredWrites* deferred = nullptr);
  // Writes what Stage held in `deferred` in one backend call, and empties it
  // (also on error; the caller must then Abort every transaction staged).
  absl::Status Flush(DeferredWrites& deferred);
  // Writes Stage held back (see Stage). Owns what the held LayerAppends
  // point at: each Stage's segments and page table.
  class DeferredWrites {
   public:
    DeferredWrites();
    ~DeferredWrites();
    DeferredWrites(const DeferredWrites&) = delete;
    DeferredWrites& operator=(const DeferredWrites&) = delete;

    bool empty() const { return appends_.empty(); }
    // Whether every one of the pool's `num_layers` layers has a write held:
    // a layer-wise save's last group has come (AtomicAppend::holds_every_layer).
    bool HoldsEveryLayer(int32_t num_layers) const;
    // Drops the held writes unwritten (an aborted append).
    void Clear();
    // The producers' events the held rows are read behind, each once.
    std::vector<const void*> WaitEvents() const;

   private:
    friend class Pool;
    struct Held;
    bool Names(std::span<const LayerAppend> appends) const;
    void Hold(StagePlan& plan);  // moves the plan's appends, segments and page table in
    std::vector<std::unique_ptr<Held>> held_;
    std::vector<LayerAppend> appends_;
  };

  // Advances the lengths; the sequence is visible and free for the next
  // append. A sequence the append created that holds no page and no token
  // is not kept (the snapshot then describes it empty).
  SequenceSnapshot Commit(AppendTransaction& txn);
  // The same for several transactions under one hold of the lock, in order;
  // with kNew the snapshots carry only the pages each append allocated and
  // no per-layer lengths (what a BASIC or COMPACT response shows), with kNone
  // no page and no per-layer length (LENGTHS).
  std::vector<SequenceSnapshot> Commit(std::span<AppendTransaction* const> txns,
                                       SnapshotPages pages = SnapshotPages::kAll);
  // Restores rewritten rows, returns the pages the append allocated, erases a
  // sequence it created, unsets scales it set on a layer that stays empty.
  void Abort(AppendTransaction& txn);
  // The transactions of one call (AtomicAppend), undone in reverse order,
  // and the layers' scales any of them set restored once all have left.
  void Abort(std::span<AppendTransaction* const> txns);

  // ---- queries and releases (any thread) ----------------------------------

  PoolSnapshot Snapshot() const;
  // With `lease`: also takes a lease on the sequence's length, atomically.
  absl::StatusOr<SequenceSnapshot> GetSequence(const SequenceRef& ref,
                                               const std::optional<LeaseRequest>& lease = std::nullopt);
  // `limit` in [1, 1000]; `page_token` is the last id of the previous page.
  SequenceListing ListSequences(size_t limit, const std::string& page_token) const;
  absl::StatusOr<PageSnapshot> GetPage(int64_t page) const;
  // The id is gone at once; a leased sequence's pages stay until its last
  // lease ends (FreeResult says how many).
  absl::StatusOr<FreeResult> FreeSequence(const SequenceRef& ref);
  // A sequence cut to 0 tokens holds nothing and is removed, as by
  // FreeSequence. Below what a lease protects: FAILED_PRECONDITION.
  absl::StatusOr<SequenceSnapshot> TruncateSequence(const SequenceRef& ref, uint32_t length);

  // ---- leases and shared prefixes (any thread; Fork on worker()) -----------

  // A lease on tokens [0, tokens) (0: the length) of the sequence.
  absl::StatusOr<LeaseSnapshot> AcquireLease(const SequenceRef& ref, const LeaseRequest& lease, uint32_t tokens = 0);
  absl::StatusOr<LeaseSnapshot> RenewLease(uint64_t lease_id, absl::Duration duration);
  // Returns the pages freed (a retained sequence's last lease, a page lease).
  absl::StatusOr<uint32_t> ReleaseLease(uint64_t lease_id);
  // Leases with id > after, at most `limit`.
  LeaseListing ListLeases(size_t limit, uint64_t after);
  // Leading pages of the chain the index holds; with `lease`, a page lease on them.
  // Takes views: the RPC layer passes the request's own bytes, uncopied.
  absl::StatusOr<PrefixMatch> MatchPrefix(std::span<const absl::string_view> block_hashes,
                                          const std::optional<LeaseRequest>& lease = std::nullopt);
  absl::StatusOr<PrefixMatch> MatchPrefix(std::span<const std::string> block_hashes,
                                          const std::optional<LeaseRequest>& lease = std::nullopt);
  // Creates request.target sharing full pages of the source (or the chain),
  // copying a partial last page. On worker().
  absl::StatusOr<ForkResult> Fork(const ForkRequest& request);
  // Ends expired leases (and, through them, retained sequences); returns how many.
  int ExpireLeases();
  // The periodic upkeep: ExpireLeases, FreeIdle, and eviction above the high
  // watermark. KvCacheServer calls it about once a second.
  void Maintain();

  // ---- reads (ReadRows on worker()) ---------------------------------------

  // Checks a read of [start, start + count) of `layers` (empty: all; a layer
  // named twice is INVALID_ARGUMENT) and resolves count 0 to "up to the
  // shortest requested layer". Returns the layers to read and sets *count,
  // and *generation (if not null) to the incarnation found: a read in
  // several steps names it in each, so that it never mixes two.
  absl::StatusOr<std::vector<int32_t>> PlanRead(const SequenceRef& ref, std::span<const uint32_t> layers,
                                                uint32_t start, uint32_t* count, uint64_t* generation = nullptr);
  // Copies the stored bytes of [start, start + count) of one layer into
  // `out` ([count, 256] / [count, 32] / [count, 64]) and reports the layer's
  // scales. Fails if the sequence was freed or cut below the range meanwhile.
  absl::Status ReadRows(const SequenceRef& ref, int32_t layer, uint32_t start, uint32_t count, const EntryRows& out,
                        LayerSnapshot* layer_state) const;

  // Frees committed sequences without an append in flight that were last
  // used before now - idle_ttl (nothing when idle_ttl is zero), least
  // recently used first, at most `max_batch` per hold of the lock (the
  // sequences' storage is destroyed after the lock is released, and the
  // reaper yields between batches), so appends are not held up. Returns
  // how many were freed and logs one line per call. KvCacheServer calls it
  // periodically.
  int FreeIdle(absl::Time now, int max_batch = 128);
  // Evicts least recently used sequences until at most `target_used` pages
  // are used (LRU policy only); returns how many were evicted.
  int EvictDownTo(int32_t target_used, int max_batch = 128);
  absl::Duration idle_ttl() const { return options_.idle_ttl; }

  // ExportPool: the caches' CUDA IPC handles (FAILED_PRECONDITION on cpu). Any thread.
  absl::StatusOr<std::vector<CacheBackend::LayerHandles>> ExportHandles() const { return backend_->ExportHandles(); }

  // Checks free + used == total, that every page's references are exactly
  // the page tables naming it plus page leases plus in-flight copies, the
  // holder index, the per-layer token counts, the sequence count, that no
  // committed sequence is empty, lease bookkeeping, the prefix index, and
  // that the use-order list holds exactly the reapable sequences, oldest
  // first (tests call this after every step; it scans everything).
  absl::Status CheckInvariants() const;

 private:
  // A layer's state: what Snapshot reports (LayerSnapshot, copied as is),
  // plus what only the pool needs.
  struct LayerState : LayerSnapshot {
    int32_t staged_users = 0;  // in-flight appends with rows staged in this layer
  };

  Pool(const Options& options, std::unique_ptr<CacheBackend> backend,
       std::unique_ptr<PageAllocator> allocator);
  friend class AppendTransaction;

  // BeginAppend and Commit of one transaction, under mu_.
  absl::StatusOr<std::unique_ptr<AppendTransaction>> BeginLocked(const std::string& sequence)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What a call's commits add to the layers' counters, summed over its
  // transactions and applied once (ApplyLocked) instead of per (sequence,
  // layer): tokens gained per layer and in every layer alike (level
  // sequences' commits), staged users leaving per layer, and the users
  // leaving every layer (transactions that touched all of them).
  struct LayerTally {
    explicit LayerTally(int32_t num_layers) : tokens(num_layers, 0), users(num_layers, 0) {}
    std::vector<uint64_t> tokens;
    uint64_t tokens_of_every_layer = 0;
    std::vector<uint32_t> users;
    uint32_t users_of_every_layer = 0;
  };
  SequenceSnapshot CommitLocked(AppendTransaction& txn, int64_t now_ns, LayerTally& tally,
                                SnapshotPages pages = SnapshotPages::kAll) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyLocked(const LayerTally& tally) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Abort's work for one transaction but its scales (Abort restores them
  // once every transaction of the call is undone).
  void AbortOne(AppendTransaction& txn);
  // ---- the steps of Stage ----
  // Shape of one sequence's rows; needs no state. The call's shared layers
  // are checked with its first sequence that names them (plan.shared).
  absl::Status ValidateShape(const std::string& id, const SequenceRowsIn& rows, std::optional<DType> dtype,
                             StagePlan& plan) const;
  // The entries of one set of layers: in range, each once, `rows` rows of
  // `dtype` each, valid scales. `who` starts messages.
  absl::Status ValidateLayers(absl::FunctionRef<std::string()> who, std::span<const LayerRows> layers, uint64_t rows,
                              DType dtype) const;
  // Against the pool's state: scales, holes, expect_length; records scales
  // to set and pages to allocate in `plan`.
  absl::Status CheckState(size_t index, const AppendTransaction& txn, const SequenceRowsIn& rows, StagePlan& plan) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // CheckState's steps: the scales the rows name or need, per layer; then the
  // pages the rows need (new ones, copies of shared ones, rewritten ones).
  absl::Status CheckScales(size_t index, const AppendTransaction& txn, const SequenceRowsIn& rows, StagePlan& plan) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status PlanPages(size_t index, const AppendTransaction& txn, const SequenceRowsIn& rows, StagePlan& plan) const
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

  // `count_shared`: also count the shared entries of the page table (a pass
  // over it; appends skip it, so that a decode step's commits stay O(rows)).
  // `pages_from`: the first page-table entry copied (kNew snapshots), whose
  // per-layer lengths are left out too.
  SequenceSnapshot SnapshotOf(const Sequence& seq, bool count_shared = true, std::optional<size_t> pages_from = {}) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  LeaseSnapshot SnapshotOf(const Lease& lease) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The committed sequence `id`, or NOT_FOUND naming the pool (and saying
  // when the server evicted or reaped it, if it remembers).
  absl::StatusOr<Sequence*> FindCommitted(const std::string& id) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // FindCommitted, then the generation check; or the lease's incarnation.
  absl::StatusOr<Sequence*> Resolve(const SequenceRef& ref) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status CheckGeneration(const Sequence& seq, std::optional<uint64_t> expected) const;
  int64_t EntryOf(const Sequence& seq, uint32_t position) const;
  int64_t NowNs() const;
  // Drops one reference from each page; pages left with none are free and
  // leave the prefix index. Returns how many became free.
  // `reason` and `sequence` describe the release in the removed event of
  // the freed pages that were announced stored (pool_events.cc).
  uint32_t ReleasePages(std::span<const int32_t> pages, const char* reason = "free",
                        const std::string& sequence = "") ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases a committed, idle sequence's pages and tokens and erases it;
  // `storage` (if given) receives the sequence's node to destroy later.
  // Returns the pages that became free.
  uint32_t EraseSequence(Sequence* seq, SequencesById::node_type* storage = nullptr, const char* reason = "free")
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ---- KV events (pool_events.cc) ----
  // Announces the pages of `seq` that became complete in every layer and
  // were not announced yet (one stored event per run of them).
  void AnnounceStoredPages(Sequence* seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Page-table entries [first, last) of `seq` keep their pages but not the
  // bytes that were announced (rewritten, truncated into): a removed event
  // for those announced, which the next completion announces again.
  void WithdrawPages(Sequence* seq, size_t first, size_t last, const char* reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordEvent(KvEvent event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ---- cache management steps (pool_leases.cc, pool_sharing.cc, pool_eviction.cc)
  // The shape of a lease request (holder, duration), checked before any
  // state is read; returns the duration in ms (the default for zero).
  absl::StatusOr<int64_t> CheckLeaseRequest(const LeaseRequest& request) const;
  absl::StatusOr<int64_t> LeaseDurationMs(absl::Duration asked) const;
  // The limits, then the lease (a page lease takes a reference on each page).
  absl::StatusOr<LeaseSnapshot> AddLease(Sequence* seq, const std::string& holder, int64_t duration_ms,
                                         uint32_t tokens, std::vector<int32_t> pages)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends one lease; returns the pages that became free.
  uint32_t EndLease(uint64_t lease_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int ReapExpiredLeases() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Retains a freed, leased sequence for its leases.
  FreeResult RetainForLeases(Sequence* seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Free pages for `needed`: enough already, or (LRU) evict; else RESOURCE_EXHAUSTED.
  absl::Status MakeRoom(int64_t needed, const std::string& what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Evict(Sequence* seq, SequencesById::node_type* storage = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Indexes the pages of `seq` with a pending hash that are complete in every layer.
  void IndexCompletePages(Sequence* seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Copies the first `entries` entries of page `from` to page `to` in every layer.
  absl::Status CopyPage(int32_t from, int32_t to, uint32_t entries);

  const Options options_;
  const Device device_;
  const int64_t max_tokens_;  // num_pages x page_size
  std::unique_ptr<CacheBackend> backend_;

  mutable absl::Mutex mu_;
  std::unique_ptr<PageAllocator> allocator_ ABSL_GUARDED_BY(mu_);
  SequenceTable sequences_ ABSL_GUARDED_BY(mu_);
  std::vector<LayerState> layers_ ABSL_GUARDED_BY(mu_);
  LeaseTable leases_ ABSL_GUARDED_BY(mu_);
  // Freed sequences kept for their leases (Sequence::retained).
  std::map<const Sequence*, SequencesById::node_type> retained_ ABSL_GUARDED_BY(mu_);
  PrefixIndex prefix_ ABSL_GUARDED_BY(mu_);
  EndedSequences ended_ ABSL_GUARDED_BY(mu_);
  // References held by in-flight copy-on-writes on the page they copy from
  // (page -> count), released at Commit / restored at Abort.
  std::map<int32_t, int32_t> cow_held_ ABSL_GUARDED_BY(mu_);
  PoolSnapshot::Counters counters_ ABSL_GUARDED_BY(mu_);
  // [num_pages] 1 while a page's bytes are announced stored (KV events).
  std::vector<uint8_t> page_stored_ ABSL_GUARDED_BY(mu_);

  // Destroyed before the worker: the callbacks it cancels post there.
  std::unique_ptr<SourceWaiter> waiter_;
  // Last member: destroyed first, so queued tasks finish while the rest lives.
  std::unique_ptr<SerialExecutor> worker_;
};

}  // namespace mlakv::server
