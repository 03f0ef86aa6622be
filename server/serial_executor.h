// SerialExecutor: one worker thread running posted tasks in FIFO order.
//
// Each Pool owns one. Everything that touches a pool's cache memory (appends,
// reads, restores) runs on it, so cache accesses of a pool never overlap and
// gRPC reactions never wait for quantization or a CUDA synchronization: they
// post the work and return.
#pragma once

#include <deque>
#include <thread>

#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace mlakv::server {

class SerialExecutor {
 public:
  SerialExecutor();
  // Runs every task already posted, then joins the thread.
  ~SerialExecutor();

  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  void Post(absl::AnyInvocable<void() &&> task);
  // Tasks posted and not yet finished (for tests and metrics).
  size_t pending() const;

 private:
  void Loop();

  mutable absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> tasks_ ABSL_GUARDED_BY(mu_);
  size_t running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace mlakv::server
