#include "server/rpc/stream_watchdog.h"

namespace mlakv::server {

StreamWatchdog::StreamWatchdog(absl::Duration period) : period_(period), thread_([this] { Run(); }) {}

StreamWatchdog::~StreamWatchdog() {
  stop_.Notify();
  thread_.join();
}

void StreamWatchdog::Add(Watched* watched) {
  absl::MutexLock lock(&mu_);
  watched_.insert(watched);
}

void StreamWatchdog::Remove(Watched* watched) {
  absl::MutexLock lock(&mu_);  // waits for a tick in progress
  watched_.erase(watched);
}

size_t StreamWatchdog::size() const {
  absl::MutexLock lock(&mu_);
  return watched_.size();
}

void StreamWatchdog::Run() {
  while (!stop_.WaitForNotificationWithTimeout(period_)) {
    const absl::Time now = absl::Now();
    absl::MutexLock lock(&mu_);
    for (Watched* w : watched_) w->OnWatchdogTick(now);
  }
}

}  // namespace mlakv::server
