#include "server/core/ids.h"

#include <atomic>

#include "absl/time/clock.h"

namespace mlakv::server {

uint64_t NextId() {
  static std::atomic<uint64_t> next{static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()))};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace mlakv::server
