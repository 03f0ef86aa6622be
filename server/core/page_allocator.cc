#include "server/core/page_allocator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace mlakv::server {

absl::StatusOr<std::unique_ptr<PageAllocator>> PageAllocator::Create(const Options& options) {
  if (options.num_pages < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_pages must be >= 1, got ", options.num_pages));
  }
  return std::unique_ptr<PageAllocator>(new PageAllocator(options.num_pages));
}

PageAllocator::PageAllocator(int32_t num_pages) : refs_(num_pages, 0) {
  free_.reserve(num_pages);
  // Highest id at the bottom so that a fresh pool hands out 0, 1, 2, ...
  for (int32_t p = num_pages - 1; p >= 0; --p) free_.push_back(p);
}

absl::StatusOr<std::vector<int32_t>> PageAllocator::Allocate(int64_t count) {
  if (count < 0) return absl::InternalError(absl::StrCat("PageAllocator::Allocate(", count, ")"));
  if (count > free_count()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("needs ", count, " more pages but only ", free_count(), " of ", total(), " are free"));
  }
  std::vector<int32_t> pages(free_.end() - count, free_.end());
  std::reverse(pages.begin(), pages.end());
  free_.resize(free_.size() - count);
  for (int32_t p : pages) refs_[p] = 1;
  return pages;
}

absl::Status PageAllocator::Ref(std::span<const int32_t> pages) {
  for (int32_t p : pages) {
    if (!IsUsed(p)) return absl::InternalError(absl::StrCat("referencing page ", p, " which is not in use"));
  }
  for (int32_t p : pages) {
    if (++refs_[p] == 2) ++shared_;
  }
  return absl::OkStatus();
}

absl::Status PageAllocator::Unref(std::span<const int32_t> pages, std::vector<int32_t>* freed) {
  // Drop the references one by one (a page listed more often than it is
  // referenced is caught when its count would go below 0), put them back on
  // error, and only then touch the free list.
  size_t done = 0;
  absl::Status status;
  for (; done < pages.size(); ++done) {
    const int32_t p = pages[done];
    if (p < 0 || p >= total()) {
      status = absl::InternalError(absl::StrCat("freeing page ", p, " outside [0, ", total(), ")"));
      break;
    }
    if (refs_[p] == 0) {
      status = absl::InternalError(
          absl::StrCat("freeing page ", p, " which is not in use (or listed more often than it is referenced)"));
      break;
    }
    if (--refs_[p] == 1) --shared_;
  }
  if (!status.ok()) {
    for (size_t i = 0; i < done; ++i) {
      if (++refs_[pages[i]] == 2) ++shared_;  // nothing changes
    }
    return status;
  }
  for (int32_t p : pages) {
    if (refs_[p] != 0) continue;
    refs_[p] = -1;  // pushed once even if listed twice; reset below
    free_.push_back(p);
    if (freed != nullptr) freed->push_back(p);
  }
  for (int32_t p : pages) {
    if (refs_[p] == -1) refs_[p] = 0;
  }
  return absl::OkStatus();
}

}  // namespace mlakv::server
