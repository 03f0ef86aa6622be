#include "server/core/kv_events.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace mlakv::server {

namespace {

// Heap bytes of `s`: none while it fits the string's inline buffer.
size_t HeapBytes(const std::string& s) {
  static const size_t kInline = std::string().capacity();
  return s.capacity() > kInline ? s.capacity() + 1 : 0;
}

}  // namespace

size_t KvEventBytes(const KvEvent& e) {
  size_t bytes = sizeof(KvEvent) + HeapBytes(e.pool) + HeapBytes(e.sequence) + HeapBytes(e.parent_block_hash) +
                 HeapBytes(e.reason) + e.pages.capacity() * sizeof(int32_t) +
                 e.block_hashes.capacity() * sizeof(std::string);
  for (const std::string& h : e.block_hashes) bytes += HeapBytes(h);
  return bytes;
}

EventLog::EventLog(Options options)
    : options_{.replay_capacity = std::max<size_t>(1, options.replay_capacity),
               .replay_bytes = options.replay_bytes} {}

uint64_t EventLog::Record(KvEvent event) {
  if (event.time_unix_ns == 0) event.time_unix_ns = absl::ToUnixNanos(absl::Now());
  absl::MutexLock lock(&mu_);
  event.number = next_++;
  ring_bytes_ += KvEventBytes(event);
  ring_.push_back(std::move(event));
  while (ring_.size() > 1 && (ring_.size() > options_.replay_capacity || ring_bytes_ > options_.replay_bytes)) {
    ring_bytes_ -= KvEventBytes(ring_.front());
    ring_.pop_front();
  }
  return ring_.back().number;  // readers waiting on mu_'s conditions re-check when it is released
}

uint64_t EventLog::oldest() const {
  absl::MutexLock lock(&mu_);
  return ring_.empty() ? 0 : ring_.front().number;
}

EventLog::Stats EventLog::stats() const {
  absl::MutexLock lock(&mu_);
  return {.recorded = next_ - 1, .kept = ring_.size(), .kept_bytes = ring_bytes_};
}

uint64_t EventLog::next() const {
  absl::MutexLock lock(&mu_);
  return next_;
}

absl::Status EventLog::Read(uint64_t from, size_t max, absl::Duration timeout, std::vector<KvEvent>* out,
                            size_t max_bytes) const {
  absl::MutexLock lock(&mu_);
  struct Ready {
    const EventLog* log;
    uint64_t from;
    bool operator()() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(log->mu_) { return log->closed_ || log->next_ > from; }
  } ready{this, from};
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  if (closed_) return absl::UnavailableError("the server is shutting down; its event stream ends here");
  if (ring_.empty() || from >= next_) return absl::OkStatus();  // nothing new yet
  const uint64_t oldest = ring_.front().number;
  if (from < oldest) {
    return absl::OutOfRangeError(absl::StrCat("event ", from, " has left this server's replay buffer (it keeps the last ",
                                              options_.replay_capacity, " events and at most ", options_.replay_bytes,
                                              " bytes of them; the oldest is ", oldest,
                                              "); resume from ", oldest, " after resynchronizing (ListSequences)"));
  }
  size_t copied = 0, bytes = 0;
  for (uint64_t n = from; n < next_ && copied < max; ++n, ++copied) {
    const KvEvent& e = ring_[n - oldest];
    bytes += KvEventBytes(e);
    if (copied > 0 && bytes > max_bytes) break;
    out->push_back(e);
  }
  return absl::OkStatus();
}

void EventLog::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

}  // namespace mlakv::server
