// PageAllocator: the free list of one pool's page ids.
//
// O(1) per page: a stack of free ids plus one "used" flag per page, so that a
// double free or a foreign id is an error instead of a corrupted list.
// Invariant (checked by tests, exposed by GetPool): free + used == total.
// Not thread-safe: the owning Pool serializes access under its mutex.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mlakv::server {

class PageAllocator {
 public:
  struct Options {
    int32_t num_pages = 0;  // pages in the pool, >= 1
  };

  static absl::StatusOr<std::unique_ptr<PageAllocator>> Create(const Options& options);

  // `count` page ids, all or nothing: RESOURCE_EXHAUSTED (nothing taken) when
  // fewer than `count` are free. Ids come out lowest first on a fresh pool.
  absl::StatusOr<std::vector<int32_t>> Allocate(int64_t count);
  // Returns pages to the free list. All ids are checked first (in range, in
  // use, no duplicates); on error nothing is freed (INTERNAL: a server bug).
  absl::Status Free(std::span<const int32_t> pages);

  bool IsUsed(int32_t page) const { return page >= 0 && page < total() && used_[page]; }
  int32_t total() const { return static_cast<int32_t>(used_.size()); }
  int32_t free_count() const { return static_cast<int32_t>(free_.size()); }
  int32_t used_count() const { return total() - free_count(); }

 private:
  explicit PageAllocator(int32_t num_pages);

  std::vector<int32_t> free_;  // stack of free ids; top = back
  std::vector<bool> used_;     // [num_pages]
};

}  // namespace mlakv::server
