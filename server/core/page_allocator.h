// PageAllocator: the free list and reference counts of one pool's page ids.
//
// A page is free (0 references) or used (>= 1). Every page-table entry that
// names a page is one reference (a page shared by a fork is named by two
// tables), and so is every page lease (MatchPrefix) and every in-flight
// copy-on-write that still holds the page it is copying from. A page returns
// to the free list when its last reference is dropped.
//
// O(1) per page: a stack of free ids plus a count per page, so that dropping
// a reference nobody holds is an error instead of a corrupted list.
// Invariant (checked by tests, exposed by GetPool): free + used == total,
// a shared page counted once.
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

  // `count` page ids with one reference each, all or nothing:
  // RESOURCE_EXHAUSTED (nothing taken) when fewer than `count` are free.
  // Ids come out lowest first on a fresh pool.
  absl::StatusOr<std::vector<int32_t>> Allocate(int64_t count);
  // One more reference to each of `pages`, which must all be used (INTERNAL
  // otherwise, nothing changed).
  absl::Status Ref(std::span<const int32_t> pages);
  // Drops one reference from each of `pages` (a page may be listed as often
  // as it is referenced); pages left with none return to the free list and
  // are appended to `freed` (if given). All ids are checked first (in range,
  // enough references); on error nothing changes (INTERNAL: a server bug).
  absl::Status Unref(std::span<const int32_t> pages, std::vector<int32_t>* freed = nullptr);

  bool IsUsed(int32_t page) const { return page >= 0 && page < total() && refs_[page] > 0; }
  // References to `page` (0: free).
  int32_t refs(int32_t page) const { return refs_[page]; }
  int32_t total() const { return static_cast<int32_t>(refs_.size()); }
  int32_t free_count() const { return static_cast<int32_t>(free_.size()); }
  int32_t used_count() const { return total() - free_count(); }
  // Used pages with more than one reference.
  int32_t shared_count() const { return shared_; }

 private:
  explicit PageAllocator(int32_t num_pages);

  std::vector<int32_t> free_;  // stack of free ids; top = back
  std::vector<int32_t> refs_;  // [num_pages]
  int32_t shared_ = 0;
};

}  // namespace mlakv::server
