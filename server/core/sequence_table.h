// SequenceTable: the sequences of one pool by id (ordered, for paginated
// listings), the reverse index page -> (owner, index in its page table), and
// the use-order list of idle sequences.
//
// Bookkeeping is O(1) or O(log n) per operation, never a scan of every
// sequence: counts are kept as the state changes, and the sequences that
// may be reaped (committed, no append in flight) are linked in one list from
// least to most recently used, so the idle reaper (and, later, eviction)
// reads only the sequences it frees (docs/reliability.md "Bounded resources").
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

#include "server/core/sequence.h"

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
  // Adds an empty, uncommitted, busy sequence; `id` must be absent.
  Sequence* Add(std::string id);
  // Removes a sequence that holds no pages (its pages detached first).
  void Erase(Sequence* sequence);
  // The same, but hands the sequence's storage to the caller, which may
  // destroy it later (outside the pool's lock: freeing a node is most of
  // the cost of erasing it).
  SequencesById::node_type Extract(Sequence* sequence);

  // An append takes an idle committed sequence (it leaves the use-order
  // list) / gives it back committed (it joins the list as the most recently
  // used, at `now_ns`).
  void MarkBusy(Sequence* sequence);
  void MarkIdle(Sequence* sequence, int64_t now_ns);
  void SetCommitted(Sequence* sequence);
  // Records a use: the sequence becomes the most recently used.
  void Touch(Sequence* sequence, int64_t now_ns);
  // The least recently used idle committed sequence, or null.
  Sequence* LeastRecentlyUsed() const { return lru_head_; }
  // The next more recently used one, or null.
  static Sequence* MoreRecent(const Sequence* sequence) { return sequence->lru_next_; }

  // Appends `pages` to the sequence's page table and records ownership.
  void AttachPages(Sequence* sequence, std::span<const int32_t> pages);
  // Cuts the page table to `keep` pages; returns the ids cut off.
  std::vector<int32_t> DetachTail(Sequence* sequence, size_t keep);

  const Owner& OwnerOf(int32_t page) const { return owners_[page]; }

  // Committed sequences with id > `after`, in id order, at most `limit`
  // (O(log n + limit + uncommitted ids skipped)).
  std::vector<const Sequence*> ListAfter(std::string_view after, size_t limit) const;
  size_t committed_count() const { return committed_count_; }
  // Every sequence, committed or not (what a pool's cap counts).
  size_t size() const { return by_id_.size(); }

 private:
  // `now_ns`, or the most recent use in the list if that is later.
  int64_t NotBeforeTail(int64_t now_ns) const;
  void Link(Sequence* sequence);
  void Unlink(Sequence* sequence);

  int32_t num_layers_;
  SequencesById by_id_;
  std::vector<Owner> owners_;  // [num_pages]
  size_t committed_count_ = 0;
  Sequence* lru_head_ = nullptr;  // least recently used
  Sequence* lru_tail_ = nullptr;  // most recently used
};

}  // namespace mlakv::server
