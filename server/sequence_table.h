// SequenceTable: the sequences of one pool by id (ordered, for paginated
// listings) and the reverse index page -> (owner, index in its page table).
// Page ids themselves come from the PageAllocator; this table only records
// who holds them. Not thread-safe: the owning Pool holds its mutex.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "server/sequence.h"

namespace mlakv::server {

class SequenceTable {
 public:
  struct Owner {
    Sequence* sequence = nullptr;  // null: page not held by a sequence
    uint32_t page_index = 0;       // index in the owner's page table
  };

  SequenceTable(int32_t num_layers, int32_t num_pages) : num_layers_(num_layers), owners_(num_pages) {}

  // Null when absent (committed or not).
  Sequence* Find(std::string_view id) const;
  // Adds an empty, uncommitted sequence; `id` must be absent.
  Sequence* Add(std::string id);
  // Removes a sequence that holds no pages.
  void Erase(Sequence* sequence);

  // Appends `pages` to the sequence's page table and records ownership.
  void AttachPages(Sequence* sequence, std::span<const int32_t> pages);
  // Cuts the page table to `keep` pages; returns the ids cut off.
  std::vector<int32_t> DetachTail(Sequence* sequence, size_t keep);

  const Owner& OwnerOf(int32_t page) const { return owners_[page]; }

  // Committed sequences with id > `after`, in id order, at most `limit`.
  std::vector<const Sequence*> ListAfter(std::string_view after, size_t limit) const;
  size_t committed_count() const;

 private:
  int32_t num_layers_;
  std::map<std::string, std::unique_ptr<Sequence>, std::less<>> by_id_;
  std::vector<Owner> owners_;  // [num_pages]
};

}  // namespace mlakv::server
