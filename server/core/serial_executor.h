// SerialExecutor: one worker thread running posted tasks in FIFO order, and
// callers that may run a task on their own thread in its place.
//
// Each Pool owns one. Everything that touches a pool's cache memory (appends,
// reads, restores) is one of its tasks, so cache accesses of a pool never
// overlap. gRPC's threads never wait for quantization or a CUDA
// synchronization: they Post the work and return, or RunOrPost it: when no
// task is running or queued, the task runs at once on the caller's thread --
// no wake-up of the worker and back, ~20-30 us a call on the GPU host
// (docs/performance.md) -- and otherwise it is queued like a posted one. A
// caller that may block uses RunHere, which waits for a queued task.
// Either way tasks never overlap, and a caller's tasks run in its order.
//
// An optional start hook runs once on the worker thread before any task; a
// pool on a GPU makes its device current there (Device::BindThread), so
// every CUDA call of its tasks starts on the pool's device.
#pragma once

#include <chrono>
#include <deque>
#include <thread>

#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace mlakv::server {

class SerialExecutor {
 public:
  // `on_start` (may be null) runs on the worker thread before the first task.
  explicit SerialExecutor(absl::AnyInvocable<void() &&> on_start = nullptr);
  // Runs every task already posted, then joins the thread.
  ~SerialExecutor();

  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  void Post(absl::AnyInvocable<void() &&> task);
  // Runs `task` as one of the executor's tasks and returns when it is done:
  // on the calling thread if the executor is idle, else on the worker after
  // the tasks queued before it. The on_start hook does not run on the
  // calling thread (CUDA backends set their device per call).
  void RunHere(absl::FunctionRef<void()> task);
  // Runs `task` as one of the executor's tasks without waiting for the
  // others: on the calling thread at once when the executor is idle (the
  // same hand-over saved as RunHere), else posted behind the tasks queued
  // before it. For callers that must not block (a completion-queue thread),
  // whose task finishes its call itself.
  void RunOrPost(absl::AnyInvocable<void() &&> task);
  // Tasks posted and not yet finished (for tests and metrics).
  size_t pending() const;
  // Whether the calling thread is the executor's own worker (a task run by
  // RunHere or RunOrPost on a caller's thread is not).
  bool OnWorkerThread() const { return std::this_thread::get_id() == thread_.get_id(); }
  // How loaded the executor is: the time spent running tasks since it
  // started (on the worker and RunHere callers), whose rate is its
  // utilization (1 = saturated), and pending().
  struct Load {
    double busy_seconds = 0;
    size_t pending = 0;
  };
  Load load() const;

 private:
  void Loop(absl::AnyInvocable<void() &&> on_start);
  void SetBusy() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetIdle() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> tasks_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // a task runs (on the worker or a RunHere caller)
  // Since the start: the finished tasks' run time, and when the running one began.
  std::chrono::steady_clock::duration busy_total_ ABSL_GUARDED_BY(mu_){};
  std::chrono::steady_clock::time_point busy_since_ ABSL_GUARDED_BY(mu_){};
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace mlakv::server
