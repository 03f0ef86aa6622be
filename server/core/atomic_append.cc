#include "server/core/atomic_append.h"

#include "common/status_macros.h"

namespace mlakv::server {

absl::Status AtomicAppend::Begin(const std::string& sequence) {
  if (finished_) return absl::InternalError("AtomicAppend::Begin after the append finished");
  MLAKV_ASSIGN_OR_RETURN(std::unique_ptr<AppendTransaction> txn, pool_->BeginAppend(sequence));
  txns_.push_back(std::move(txn));
  return absl::OkStatus();
}

absl::Status AtomicAppend::Begin(std::span<const std::string* const> sequences) {
  if (finished_) return absl::InternalError("AtomicAppend::Begin after the append finished");
  return pool_->BeginAppends(sequences, &txns_);
}

absl::Status AtomicAppend::Stage(std::span<const SequenceRowsIn* const> rows, std::optional<DType> dtype) {
  if (finished_) return absl::InternalError("AtomicAppend::Stage after the append finished");
  std::vector<AppendTransaction*> raw;
  raw.reserve(txns_.size());
  for (const auto& txn : txns_) raw.push_back(txn.get());
  return pool_->Stage(raw, rows, dtype, hold_device_writes_ ? &held_ : nullptr);
}

absl::StatusOr<std::vector<SequenceSnapshot>> AtomicAppend::Commit(absl::FunctionRef<absl::Status()> last_check) {
  if (finished_) return absl::InternalError("AtomicAppend::Commit after the append finished");
  if (absl::Status s = pool_->Flush(held_); !s.ok()) {
    Abort();
    return s;
  }
  if (absl::Status s = last_check(); !s.ok()) {
    Abort();
    return s;
  }
  std::vector<AppendTransaction*> raw;
  raw.reserve(txns_.size());
  for (const auto& txn : txns_) raw.push_back(txn.get());
  std::vector<SequenceSnapshot> out = pool_->Commit(raw);
  finished_ = true;
  return out;
}

void AtomicAppend::Abort() {
  if (finished_) return;
  held_.Clear();  // never written: nothing of them reached the caches
  // Reverse order: a later transaction's changes are undone before an earlier one's.
  for (auto it = txns_.rbegin(); it != txns_.rend(); ++it) pool_->Abort(**it);
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
