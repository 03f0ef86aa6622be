#include "server/cq/queue_threads.h"

#include <pthread.h>

#include <algorithm>

#include "absl/time/clock.h"
#include "common/tsan_annotations.h"

namespace mlakv::server::cq {

QueueThreads::QueueThreads(std::unique_ptr<grpc::ServerCompletionQueue> queue, int threads, std::string name,
                           absl::Duration poll_period)
    : queue_(std::move(queue)),
      threads_(std::max(1, threads)),
      name_(std::move(name)),
      poll_period_(std::max(poll_period, absl::ZeroDuration())) {}

QueueThreads::~QueueThreads() { Shutdown(); }

int QueueThreads::DefaultThreads() {
  return std::clamp(static_cast<int>(std::thread::hardware_concurrency() / 2), 2, 16);
}

void QueueThreads::Start() {
  for (int t = 0; t < threads_; ++t) {
    workers_.emplace_back([this, t] {
      // Linux names are 15 bytes at most: "rpc-name-N" cut to fit.
      const std::string thread_name = (name_ + "-" + std::to_string(t)).substr(0, 15);
      pthread_setname_np(pthread_self(), thread_name.c_str());
      if (poll_period_ > absl::ZeroDuration()) {
        ServePolled();
      } else {
        Serve();
      }
    });
  }
}

thread_local QueueThreads* QueueThreads::turn_holder_ = nullptr;

void QueueThreads::Serve() {
  void* tag = nullptr;
  bool ok = false;
  for (;;) {
    TakeTurn();
    // Poll, run, poll again, for as long as this thread keeps the turn.
    do {
      if (!queue_->Next(&tag, &ok)) {
        // Shut down and drained: the next thread's Next() says so too.
        ReleaseTurn();
        return;
      }
      // The operation's start (on any thread) happens before this: gRPC's
      // contract, made through its lock-free queue (common/tsan_annotations.h).
      MLAKV_TSAN_HAPPENS_AFTER(tag);
      static_cast<Tag*>(tag)->Proceed(ok);
      // The turn was passed on (LetAnotherPoll), or the server went quiet
      // and other threads poll: wait for a turn.
    } while (turn_holder_ == this && !TooManyPollers());
    if (turn_holder_ == this) ReleaseTurn();
  }
}

int QueueThreads::pollers_allowed() const {
  return busy_calls_.load(std::memory_order_relaxed) >= kBusyCalls ? threads_ : 1;
}

bool QueueThreads::TooManyPollers() const { return pollers_.load(std::memory_order_relaxed) > pollers_allowed(); }

void QueueThreads::TakeTurn() {
  absl::MutexLock lock(&turn_mu_);
  turn_mu_.Await(absl::Condition(
      +[](QueueThreads* q) { return q->pollers_.load(std::memory_order_relaxed) < q->pollers_allowed(); }, this));
  pollers_.fetch_add(1, std::memory_order_relaxed);
  turn_holder_ = this;
}

void QueueThreads::ReleaseTurn() {
  turn_holder_ = nullptr;
  absl::MutexLock lock(&turn_mu_);
  pollers_.fetch_sub(1, std::memory_order_relaxed);  // the unlock wakes a thread waiting in TakeTurn
}

void QueueThreads::LetAnotherPoll() {
  if (turn_holder_ != nullptr) turn_holder_->ReleaseTurn();
}

void QueueThreads::CallBusy() {
  // Only the step to kBusyCalls lets waiting threads poll; taking the lock
  // for it is what wakes them (absl re-checks Await conditions on unlock).
  if (busy_calls_.fetch_add(1, std::memory_order_relaxed) + 1 == kBusyCalls) {
    absl::MutexLock lock(&turn_mu_);
  }
}

void QueueThreads::CallIdle() { busy_calls_.fetch_sub(1, std::memory_order_relaxed); }

void QueueThreads::ServePolled() {
  void* tag = nullptr;
  bool ok = false;
  for (;;) {
    // gpr_time_0: the deadline has passed, so AsyncNext returns at once with
    // what is ready; at most it polls the sockets once without waiting (when
    // no other thread of the process is polling), never blocking as a poller.
    switch (queue_->AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC))) {
      case grpc::CompletionQueue::GOT_EVENT:
        MLAKV_TSAN_HAPPENS_AFTER(tag);
        static_cast<Tag*>(tag)->Proceed(ok);
        break;
      case grpc::CompletionQueue::TIMEOUT:
        absl::SleepFor(poll_period_);
        break;
      case grpc::CompletionQueue::SHUTDOWN:
        return;
    }
  }
}

void QueueThreads::CallCreated() {
  absl::MutexLock lock(&mu_);
  ++alive_;
}

void QueueThreads::CallDeleted() {
  absl::MutexLock lock(&mu_);
  --alive_;
}

int QueueThreads::calls_alive() const {
  absl::MutexLock lock(&mu_);
  return alive_;
}

void QueueThreads::Shutdown() {
  if (shut_down_.exchange(true)) return;
  if (!workers_.empty()) {
    // The server is shut down: every request still armed comes back not ok
    // (its call deletes itself), every call in flight was cancelled and ends
    // as its operations come back. Nothing new can start.
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* alive) { return *alive == 0; }, &alive_));
  }
  queue_->Shutdown();
  if (workers_.empty()) {
    // Never started (the server failed to build): drain here.
    void* tag = nullptr;
    bool ok = false;
    while (queue_->Next(&tag, &ok)) static_cast<Tag*>(tag)->Proceed(ok);
  }
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

}  // namespace mlakv::server::cq
