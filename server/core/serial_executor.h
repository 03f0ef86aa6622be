// SerialExecutor: one worker thread running posted tasks in FIFO order.
//
// Each Pool owns one. Everything that touches a pool's cache memory (appends,
// reads, restores) runs on it, so cache accesses of a pool never overlap and
// gRPC reactions never wait for quantization or a CUDA synchronization: they
// post the work and return.
//
// An optional start hook runs once on the worker thread before any task; a
// pool on a GPU makes its device current there (Device::BindThread), so
// every CUDA call of its tasks starts on the pool's device.
#pragma once

#include <deque>
#include <thread>

#include "absl/functional/any_invocable.h"
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
  // Tasks posted and not yet finished (for tests and metrics).
  size_t pending() const;

 private:
  void Loop(absl::AnyInvocable<void() &&> on_start);

  mutable absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> tasks_ ABSL_GUARDED_BY(mu_);
  size_t running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace mlakv::server
