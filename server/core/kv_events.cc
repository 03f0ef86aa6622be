#include "server/core/kv_events.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace mlakv::server {

EventLog::EventLog(Options options)
    : options_{.replay_capacity = std::max<size_t>(1, options.replay_capacity)} {}

uint64_t EventLog::Record(KvEvent event) {
  if (event.time_unix_ns == 0) event.time_unix_ns = absl::ToUnixNanos(absl::Now());
  absl::MutexLock lock(&mu_);
  event.number = next_++;
  ring_.push_back(std::move(event));
  while (ring_.size() > options_.replay_capacity) ring_.pop_front();
  return ring_.back().number;  // readers waiting on mu_'s conditions re-check when it is released
}

uint64_t EventLog::oldest() const {
  absl::MutexLock lock(&mu_);
  return ring_.empty() ? 0 : ring_.front().number;
}

uint64_t EventLog::next() const {
  absl::MutexLock lock(&mu_);
  return next_;
}

absl::Status EventLog::Read(uint64_t from, size_t max, absl::Duration timeout, std::vector<KvEvent>* out) const {
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
                                              options_.replay_capacity, " events; the oldest is ", oldest,
                                              "); resume from ", oldest, " after resynchronizing (ListSequences)"));
  }
  for (uint64_t n = from; n < next_ && out->size() < max; ++n) out->push_back(ring_[n - oldest]);
  return absl::OkStatus();
}

void EventLog::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

}  // namespace mlakv::server
