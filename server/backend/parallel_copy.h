// ParallelCopy: host memcpy of many bytes split over a few threads.
//
// The CUDA backend stages appended rows into pinned memory on the pool's one
// worker thread before a single H2D copy; for a 4 MB message that memcpy was
// the largest piece of the worker's time, and with several connections the
// worker is the bottleneck (docs/performance.md). Copies of at least
// kMinParallelBytes are cut into chunks that the calling thread and `helpers`
// persistent threads take from a shared counter; smaller ones are a plain
// memcpy on the caller. Copy() returns when every byte is copied and every
// helper has finished with this call's chunks (so the next call may rebuild
// them); calls are serialized by the caller (one pool worker).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstddef>
#include <mutex>
#include <span>
#include <thread>
#include <vector>


namespace mlakv::server {

struct CopyJob {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};

class ParallelCopy {
 public:
  static constexpr size_t kMinParallelBytes = 1 << 20;
  static constexpr size_t kChunkBytes = 256 << 10;

  explicit ParallelCopy(int helpers);
  ~ParallelCopy();
  ParallelCopy(const ParallelCopy&) = delete;
  ParallelCopy& operator=(const ParallelCopy&) = delete;

  void Copy(std::span<const CopyJob> jobs);

 private:
  struct Chunk {
    char* dst;
    const char* src;
    size_t bytes;
  };
  void Helper();
  // Copies chunks until none is left to take.
  void Drain();

  // std::mutex rather than absl::Mutex so that ThreadSanitizer, which sees
  // pthread locks but not those of an uninstrumented absl, can check this
  // hand-off (tests/server/parallel_copy_test.cc under -fsanitize=thread).
  std::vector<Chunk> chunks_;    // this call's chunks; changed only while no helper is draining
  std::atomic<size_t> next_{0};  // next chunk to take
  std::mutex mu_;
  std::condition_variable work_;      // helpers wait here for a new generation (or stop)
  std::condition_variable finished_cv_;  // Copy() waits here for the helpers
  uint64_t generation_ = 0;  // guarded by mu_: one per Copy() that uses the helpers
  size_t finished_ = 0;      // guarded by mu_: helpers done with the current generation
  bool stopping_ = false;    // guarded by mu_
  std::vector<std::thread> helpers_;
};

}  // namespace mlakv::server
