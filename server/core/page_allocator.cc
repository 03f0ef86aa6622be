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

PageAllocator::PageAllocator(int32_t num_pages) : used_(num_pages, false) {
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
  for (int32_t p : pages) used_[p] = true;
  return pages;
}

absl::Status PageAllocator::Free(std::span<const int32_t> pages) {
  absl::Status status;
  size_t checked = 0;
  for (; checked < pages.size(); ++checked) {
    const int32_t p = pages[checked];
    if (p < 0 || p >= total()) {
      status = absl::InternalError(absl::StrCat("freeing page ", p, " outside [0, ", total(), ")"));
      break;
    }
    if (!used_[p]) {
      status = absl::InternalError(absl::StrCat("freeing page ", p, " which is not in use (or listed twice)"));
      break;
    }
    used_[p] = false;  // so that a duplicate later in `pages` is caught
  }
  if (!status.ok()) {
    for (size_t i = 0; i < checked; ++i) used_[pages[i]] = true;  // nothing freed
    return status;
  }
  for (int32_t p : pages) free_.push_back(p);
  return absl::OkStatus();
}

}  // namespace mlakv::server
