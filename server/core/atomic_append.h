// AtomicAppend: one atomic append call — an Append stream (one sequence,
// staged message by message) or an AppendBatch (many sequences, staged at
// once) — as the RPC layer drives it, on the pool's worker:
//
//   AtomicAppend a(pool);
//   a.Begin("seq")...;            // one transaction per sequence
//   a.Stage(rows, dtype)...;      // any number of times; an error leaves it to Abort
//   a.Commit(last_check)          // or a.Abort()
//
// Commit runs `last_check` right before anything becomes visible (the call
// still alive and within its deadline, the response within the send limit)
// and aborts instead when it fails, so a call that fails is never applied.
// Every method runs on the pool's worker (docs/server.md "Concurrency"); the
// destructor aborts what is neither committed nor aborted, on the thread that
// destroys it, which the RPC layer makes the worker too.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/core/append_transaction.h"
#include "server/core/pool.h"

namespace mlakv::server {

class AtomicAppend {
 public:
  explicit AtomicAppend(Pool* pool) : pool_(pool) {}
  ~AtomicAppend() { Abort(); }
  AtomicAppend(const AtomicAppend&) = delete;
  AtomicAppend& operator=(const AtomicAppend&) = delete;

  Pool& pool() const { return *pool_; }
  // Holds one more sequence (Pool::BeginAppend's errors).
  absl::Status Begin(const std::string& sequence);
  // Holds several (Pool::BeginAppends: one hold of the pool's lock).
  absl::Status Begin(std::span<const std::string* const> sequences);
  size_t size() const { return txns_.size(); }
  const AppendTransaction& transaction(size_t i) const { return *txns_[i]; }

  // Holds the writes of rows read in place from device memory back until
  // Commit, which writes them in one backend call (Pool::Stage's `deferred`):
  // an Append stream by reference gives its layers message by message while
  // the producer's GPU is still computing them, and quantizing each message
  // as it came made the server's GPU work interleave with the producer's.
  void HoldDeviceWrites() { hold_device_writes_ = true; }
  // The producers' events the held writes are read behind (each once):
  // what Commit's write waits for.
  std::vector<const void*> HeldWaitEvents() const { return held_.WaitEvents(); }
  // Whether writes are held back for the commit.
  bool holds_writes() const { return !held_.empty(); }
  // Whether a write is held for every layer of the pool: nothing a stream
  // can still send joins them without flushing them first (a layer named
  // again does), so they may as well be written now.
  bool holds_every_layer() const { return held_.HoldsEveryLayer(pool_->num_layers()); }
  // Writes what is held now, in one backend call, before the commit (which
  // then has nothing left to write). Waits in the backend for the held rows'
  // events: call it once they have completed (HeldWaitEvents). On an error
  // the append is aborted and the status returned.
  absl::Status WriteHeld();
  // Stages rows for every transaction, rows[i] for transaction i (Pool::Stage).
  absl::Status Stage(std::span<const SequenceRowsIn* const> rows, std::optional<DType> dtype);

  // Writes what was held back (HoldDeviceWrites), then runs `last_check`;
  // if both pass, commits every transaction and returns the sequences after
  // the append, in Begin order; else aborts and returns the status.
  // `pages`: as Pool::Commit's.
  absl::StatusOr<std::vector<SequenceSnapshot>> Commit(absl::FunctionRef<absl::Status()> last_check,
                                                       SnapshotPages pages = SnapshotPages::kAll);
  // Rolls every transaction back (idempotent; nothing after a Commit).
  void Abort();
  bool finished() const { return finished_; }

  // Over all transactions, so far.
  uint64_t rows_written() const;
  uint32_t pages_allocated() const;

 private:
  absl::Status NamedTwiceOr(const std::string& sequence, absl::Status status) const;

  Pool* pool_;
  std::vector<std::unique_ptr<AppendTransaction>> txns_;
  bool hold_device_writes_ = false;
  Pool::DeferredWrites held_;
  bool finished_ = false;
};

}  // namespace mlakv::server
