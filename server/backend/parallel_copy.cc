#include "server/backend/parallel_copy.h"

#include <algorithm>
#include <cstring>

namespace mlakv::server {

ParallelCopy::ParallelCopy(int helpers) {
  // Counted as finished until the first generation, so a Copy() never waits
  // for a helper that has not started yet.
  finished_ = static_cast<size_t>(std::max(helpers, 0));
  for (int i = 0; i < helpers; ++i) helpers_.emplace_back([this] { Helper(); });
}

ParallelCopy::~ParallelCopy() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_.notify_all();
  for (std::thread& t : helpers_) t.join();
}

void ParallelCopy::Drain() {
  for (size_t i = next_.fetch_add(1); i < chunks_.size(); i = next_.fetch_add(1)) {
    std::memcpy(chunks_[i].dst, chunks_[i].src, chunks_[i].bytes);
  }
}

void ParallelCopy::Helper() {
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    Drain();
    bool last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last = ++finished_ == helpers_.size();
    }
    if (last) finished_cv_.notify_one();
  }
}

void ParallelCopy::Copy(std::span<const CopyJob> jobs) {
  size_t total = 0;
  for (const CopyJob& j : jobs) total += j.bytes;
  if (helpers_.empty() || total < kMinParallelBytes) {
    for (const CopyJob& j : jobs) std::memcpy(j.dst, j.src, j.bytes);
    return;
  }
  // No helper is draining here: the previous call waited for all of them.
  chunks_.clear();
  for (const CopyJob& j : jobs) {
    for (size_t off = 0; off < j.bytes; off += kChunkBytes) {
      chunks_.push_back({static_cast<char*>(j.dst) + off, static_cast<const char*>(j.src) + off,
                         std::min(kChunkBytes, j.bytes - off)});
    }
  }
  next_.store(0);
  {
    std::lock_guard<std::mutex> lock(mu_);  // publishes chunks_ and next_ to the helpers
    finished_ = 0;
    ++generation_;
  }
  work_.notify_all();
  Drain();
  // Every chunk is taken once the caller's Drain returns; it is copied once
  // the helper that took it has finished.
  std::unique_lock<std::mutex> lock(mu_);
  finished_cv_.wait(lock, [&] { return finished_ == helpers_.size(); });
}

}  // namespace mlakv::server
