#include "server/core/source_waiter.h"

#include <utility>

namespace mlakv::server {

absl::Status SourcesLateError() {
  return absl::DeadlineExceededError("the producer's CUDA event did not complete in time");
}

absl::Status SourcesAbandonedError() {
  return absl::CancelledError("the call was cancelled (by its client, or by the server shutting down) first");
}

SourceWaiter::SourceWaiter(CacheBackend* backend, absl::AnyInvocable<void() &&> on_start)
    : backend_(backend), on_start_(std::move(on_start)) {}

SourceWaiter::~SourceWaiter() {
  std::thread thread;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    thread = std::move(thread_);
  }
  if (thread.joinable()) thread.join();
}

void SourceWaiter::Wait(std::vector<const void*> events, WaitLimits limits, Done done) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      incoming_.push_back(Entry{std::move(events), std::move(limits), std::move(done)});
      ++waiting_;
      if (!thread_.joinable()) {  // the first wait starts the thread (most pools never wait)
        thread_ = std::thread([this, on_start = std::move(on_start_)]() mutable { Loop(std::move(on_start)); });
      }
      return;
    }
  }
  std::move(done)(absl::CancelledError("the pool is shutting down"));
}

size_t SourceWaiter::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiting_;
}

void SourceWaiter::Loop(absl::AnyInvocable<void() &&> on_start) {
  if (on_start) std::move(on_start)();
  std::vector<Entry> entries;  // this thread's alone
  while (true) {
    bool stopping;
    if (!entries.empty()) std::this_thread::yield();  // polling: the commit waits on this loop's latency
    {
      absl::MutexLock lock(&mu_);
      // Asleep while nothing waits; polling while something does.
      auto wake = [this] { return stopping_ || !incoming_.empty(); };
      if (entries.empty()) mu_.Await(absl::Condition(&wake));
      for (Entry& e : incoming_) entries.push_back(std::move(e));
      incoming_.clear();
      stopping = stopping_;
    }
    std::vector<std::pair<Done, absl::Status>> finished;
    const absl::Time now = absl::Now();
    for (size_t i = 0; i < entries.size();) {
      absl::Status status;
      bool over = true;
      if (stopping) {
        status = absl::CancelledError("the pool is shutting down");
      } else if (entries[i].limits.Abandoned()) {
        status = SourcesAbandonedError();
      } else if (absl::StatusOr<bool> complete = backend_->EventsComplete(entries[i].events); !complete.ok()) {
        status = complete.status();
      } else if (!*complete) {
        over = now >= entries[i].limits.deadline;
        if (over) status = SourcesLateError();
      }
      if (!over) {
        ++i;
        continue;
      }
      finished.emplace_back(std::move(entries[i].done), std::move(status));
      entries[i] = std::move(entries.back());
      entries.pop_back();
    }
    if (!finished.empty()) {
      absl::MutexLock lock(&mu_);
      waiting_ -= finished.size();
    }
    for (auto& [done, status] : finished) std::move(done)(std::move(status));
    if (stopping) {
      absl::MutexLock lock(&mu_);
      if (incoming_.empty() && entries.empty()) return;
    }
  }
}

}  // namespace mlakv::server
