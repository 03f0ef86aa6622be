// Messages of finished calls, cleared and kept for the next calls of the
// same method: a bounded free list.
//
// Why: a protobuf message parsed into a cleared one reuses the sub-messages
// and strings the clear left allocated (RepeatedPtrField keeps its cleared
// elements, a string its capacity) instead of allocating each of them
// again, and a finished call's message is cleared rather than freed piece by
// piece. A decode step by reference (256 sequences, ~9 KB on the wire) parses
// in ~12 us into a cleared message against ~15 us into a fresh one on the
// development VM (docs/performance.md "Requests parsed into the last call's
// message").
//
// Bounded: at most `max_kept` messages, and only those `keep` accepts (the
// caller's size limit: a cleared message keeps about as much memory as it
// last held, so a 4 MB request of rows is never kept).
#pragma once

#include <absl/synchronization/mutex.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace mlakv::server::cq {

template <class T>
class MessageRecycler {
 public:
  MessageRecycler(size_t max_kept, std::function<bool(const T&)> keep) : max_kept_(max_kept), keep_(std::move(keep)) {}

  // A kept message (cleared), or a fresh one.
  std::unique_ptr<T> Take() {
    {
      absl::MutexLock lock(&mu_);
      if (!kept_.empty()) {
        std::unique_ptr<T> m = std::move(kept_.back());
        kept_.pop_back();
        return m;
      }
    }
    return std::make_unique<T>();
  }

  // Clears and keeps `m` when `keep` accepts it and there is room; else
  // frees it.
  void Give(std::unique_ptr<T> m) {
    if (m == nullptr || !keep_(*m)) return;
    m->Clear();  // outside the lock
    absl::MutexLock lock(&mu_);
    if (kept_.size() < max_kept_) kept_.push_back(std::move(m));
  }

  size_t kept() const {
    absl::MutexLock lock(&mu_);
    return kept_.size();
  }

 private:
  const size_t max_kept_;
  const std::function<bool(const T&)> keep_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<T>> kept_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mlakv::server::cq
