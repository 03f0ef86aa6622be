#include "server/core/atomic_append.h"

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"

namespace mlakv::server {

absl::Status AtomicAppend::Begin(const std::string& sequence) {
  if (finished_) return absl::InternalError("AtomicAppend::Begin after the append finished");
  absl::StatusOr<std::unique_ptr<AppendTransaction>> txn = pool_->BeginAppend(sequence);
  if (!txn.ok()) return NamedTwiceOr(sequence, txn.status());
  txns_.push_back(*std::move(txn));
  return absl::OkStatus();
}

absl::Status AtomicAppend::Begin(std::span<const std::string* const> sequences) {
  if (finished_) return absl::InternalError("AtomicAppend::Begin after the append finished");
  const size_t before = txns_.size();
  absl::Status s = pool_->BeginAppends(sequences, &txns_);
  // BeginAppends stops at the first sequence it cannot begin.
  if (!s.ok() && txns_.size() - before < sequences.size()) return NamedTwiceOr(*sequences[txns_.size() - before], s);
  return s;
}

// A sequence this append already holds is busy to the pool (ABORTED, "another
// append in progress"); here it is the caller naming it twice. Checked only
// on that error, not with a set of the call's ids up front.
absl::Status AtomicAppend::NamedTwiceOr(const std::string& sequence, absl::Status status) const {
  if (!absl::IsAborted(status)) return status;
  for (const auto& txn : txns_) {
    if (txn->sequence_id() == sequence) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", Quote(sequence), " appears twice in one call; merge its rows"));
    }
  }
  return status;
}

absl::Status AtomicAppend::Stage(std::span<const SequenceRowsIn* const> rows, std::optional<DType> dtype) {
  if (finished_) return absl::InternalError("AtomicAppend::Stage after the append finished");
  std::vector<AppendTransaction*> raw;
  raw.reserve(txns_.size());
  for (const auto& txn : txns_) raw.push_back(txn.get());
  return pool_->Stage(raw, rows, dtype, hold_device_writes_ ? &held_ : nullptr);
}

absl::Status AtomicAppend::WriteHeld() {
  if (finished_) return absl::InternalError("AtomicAppend::WriteHeld after the append finished");
  if (absl::Status s = pool_->Flush(held_); !s.ok()) {
    Abort();
    return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SequenceSnapshot>> AtomicAppend::Commit(absl::FunctionRef<absl::Status()> last_check,
                                                                   SnapshotPages pages) {
  if (finished_) return absl::InternalError("AtomicAppend::Commit after the append finished");
  MLAKV_RETURN_IF_ERROR(WriteHeld());  // aborted on an error
  if (absl::Status s = last_check(); !s.ok()) {
    Abort();
    return s;
  }
  std::vector<AppendTransaction*> raw;
  raw.reserve(txns_.size());
  for (const auto& txn : txns_) raw.push_back(txn.get());
  std::vector<SequenceSnapshot> out = pool_->Commit(raw, pages);
  finished_ = true;
  return out;
}

void AtomicAppend::Abort() {
  if (finished_) return;
  held_.Clear();  // never written: nothing of them reached the caches
  std::vector<AppendTransaction*> raw;
  raw.reserve(txns_.size());
  for (const auto& txn : txns_) raw.push_back(txn.get());
  pool_->Abort(raw);  // in reverse order, scales last
  finished_ = true;
}

uint64_t AtomicAppend::rows_written() const {
  uint64_t n = 0;
  for (const auto& txn : txns_) n += txn->rows_written();
  return n;
}

uint32_t AtomicAppend::pages_allocated() const {
  uint32_t n = 0;
  for (const auto& txn : txns_) n += txn->pages_allocated();
  return n;
}

}  // namespace mlakv::server
