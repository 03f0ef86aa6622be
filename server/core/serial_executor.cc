#include "server/core/serial_executor.h"

namespace mlakv::server {

SerialExecutor::SerialExecutor(absl::AnyInvocable<void() &&> on_start)
    : thread_([this, on_start = std::move(on_start)]() mutable { Loop(std::move(on_start)); }) {}

SerialExecutor::~SerialExecutor() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void SerialExecutor::Post(absl::AnyInvocable<void() &&> task) {
  absl::MutexLock lock(&mu_);
  tasks_.push_back(std::move(task));
}

void SerialExecutor::RunHere(absl::FunctionRef<void()> task) {
  {
    absl::MutexLock lock(&mu_);
    if (busy_ || !tasks_.empty()) {
      // Behind the running and queued tasks, on the worker.
      bool done = false;
      tasks_.push_back([&] {
        task();
        absl::MutexLock done_lock(&mu_);
        done = true;
      });
      mu_.Await(absl::Condition(&done));
      return;
    }
    SetBusy();
  }
  task();
  absl::MutexLock lock(&mu_);
  SetIdle();
}

void SerialExecutor::RunOrPost(absl::AnyInvocable<void() &&> task) {
  {
    absl::MutexLock lock(&mu_);
    if (busy_ || !tasks_.empty()) {
      tasks_.push_back(std::move(task));
      return;
    }
    SetBusy();
  }
  std::move(task)();
  absl::MutexLock lock(&mu_);
  SetIdle();
}

void SerialExecutor::SetBusy() {
  busy_ = true;
  busy_since_ = std::chrono::steady_clock::now();
}

void SerialExecutor::SetIdle() {
  busy_ = false;
  busy_total_ += std::chrono::steady_clock::now() - busy_since_;
}

SerialExecutor::Load SerialExecutor::load() const {
  absl::MutexLock lock(&mu_);
  auto total = busy_total_;
  if (busy_) total += std::chrono::steady_clock::now() - busy_since_;
  return {.busy_seconds = std::chrono::duration<double>(total).count(), .pending = tasks_.size() + (busy_ ? 1 : 0)};
}

size_t SerialExecutor::pending() const {
  absl::MutexLock lock(&mu_);
  return tasks_.size() + (busy_ ? 1 : 0);
}

void SerialExecutor::Loop(absl::AnyInvocable<void() &&> on_start) {
  if (on_start) std::move(on_start)();
  while (true) {
    absl::AnyInvocable<void() &&> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](SerialExecutor* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
            return self->stopping_ ? !self->busy_ : !self->tasks_.empty() && !self->busy_;
          },
          this));
      if (tasks_.empty()) return;  // stopping and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
      SetBusy();
    }
    std::move(task)();
    absl::MutexLock lock(&mu_);
    SetIdle();
  }
}

}  // namespace mlakv::server
