// SequenceTable: the sequences of one pool by id (ordered, for paginated
// listings), the reverse index page -> holders (every page table naming the
// page, with its index there), and the use-order list of the sequences that
// the idle reaper and eviction may take.
//
// Bookkeeping is O(1) or O(log n) per operation, never a scan of every
// sequence: a lookup by id is a hash lookup (a decode step makes 256 of
// them; in the ordered map each was ~log2(n) string compares), counts are
// kept as the state changes, and the sequences that may be reaped
// (committed, no append in flight, no lease, not pinned) are linked in one
// list from least to most recently used, so the idle reaper
// and eviction read only the sequences they free (docs/reliability.md
// "Bounded resources", docs/server.md "Eviction"). Dropping one holder of a
// page shared by many is O(1) too (Sequence::owner_slot_).
// Page ids and their reference counts come from the PageAllocator; this table
// only records who names them. Not thread-safe: the owning Pool holds its mutex.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
#include "absl/container/inlined_vector.h"
#include "server/core/sequence.h"

namespace mlakv::server {

class SequenceTable {
 public:
  struct Owner {
    Sequence* sequence = nullptr;  // null: page not held by a sequence
    uint32_t page_index = 0;       // index in the owner's page table
  };
  using Holders = absl::InlinedVector<Owner, 1>;

  SequenceTable(int32_t num_layers, int32_t num_pages) : num_layers_(num_layers), holders_(num_pages) {}

  // Null when absent (committed or not).
  Sequence* Find(std::string_view id) const;
  // Adds an empty, uncommitted, busy sequence; `id` must be absent.
  Sequence* Add(std::string id, uint64_t generation);
  // Removes a sequence whose pages were detached (DetachTail(seq, 0)).
  void Erase(Sequence* sequence);
  // The same, but hands the sequence's storage to the caller, which may
  // destroy it later (outside the pool's lock: freeing a node is most of
  // the cost of erasing it).
  SequencesById::node_type Extract(Sequence* sequence);
  // Takes a sequence out of the table (its id is free again at once) but
  // keeps its page table and holder entries: a freed sequence that leases
  // still hold. The caller owns the node until the last lease ends, then
  // detaches its pages and drops it.
  SequencesById::node_type Retain(Sequence* sequence);

  // An append takes an idle committed sequence / gives it back committed (it
  // counts as used at `now_ns`).
  void MarkBusy(Sequence* sequence);
  void MarkIdle(Sequence* sequence, int64_t now_ns);
  void SetCommitted(Sequence* sequence);
  void SetPinned(Sequence* sequence);
  // A lease on `tokens` starts / ends (a sequence with leases is never
  // reaped or evicted; the end of the last one counts as a use).
  void AddLease(Sequence* sequence, uint32_t tokens);
  void RemoveLease(Sequence* sequence, uint32_t tokens, int64_t now_ns);
  // Records a use: the sequence becomes the most recently used.
  void Touch(Sequence* sequence, int64_t now_ns);
  // The least recently used reapable sequence, or null.
  Sequence* LeastRecentlyUsed() const { return lru_head_; }
  // The next more recently used one, or null.
  static Sequence* MoreRecent(const Sequence* sequence) { return sequence->lru_next_; }
  // Committed, no append in flight, no lease, not pinned, not retained: what
  // the use-order list holds.
  static bool Reapable(const Sequence& s) {
    return s.committed_ && !s.busy_ && !s.pinned_ && !s.retained_ && s.lease_tokens_.empty();
  }

  // Appends `pages` to the sequence's page table and records it as a holder.
  void AttachPages(Sequence* sequence, std::span<const int32_t> pages);
  // Cuts the page table to `keep` pages; returns the ids cut off.
  std::vector<int32_t> DetachTail(Sequence* sequence, size_t keep);
  // Page table entry `index` names `page` instead; returns the page it named.
  int32_t ReplacePage(Sequence* sequence, size_t index, int32_t page);

  // Every page table naming `page` (empty: none).
  const Holders& HoldersOf(int32_t page) const { return holders_[page]; }
  // One of them (the first), or an empty Owner.
  Owner OwnerOf(int32_t page) const { return holders_[page].empty() ? Owner{} : holders_[page].front(); }

  // Committed sequences with id > `after`, in id order, at most `limit`
  // (O(log n + limit + uncommitted ids skipped)).
  std::vector<const Sequence*> ListAfter(std::string_view after, size_t limit) const;
  size_t committed_count() const { return committed_count_; }
  // Every sequence in the table, committed or not (what a pool's cap counts).
  size_t size() const { return by_id_.size(); }
  // The hash index names exactly the ordered map's sequences (for
  // Pool::CheckInvariants).
  bool IndexMatches() const;

 private:
  // `now_ns`, or the most recent use in the list if that is later.
  int64_t NotBeforeTail(int64_t now_ns) const;
  // Links or unlinks the sequence as Reapable says.
  void Relink(Sequence* sequence);
  void Link(Sequence* sequence);
  void Unlink(Sequence* sequence);
  void AddHolder(Sequence* sequence, size_t index);
  void RemoveHolder(Sequence* sequence, size_t index);

  int32_t num_layers_;
  SequencesById by_id_;
  // The same sequences for Find: a set of the sequences themselves, hashed
  // and compared by their ids (8 bytes a slot, not a second copy of the id
  // or a view of it), so a lookup by id is one hash probe.
  struct ById {
    using is_transparent = void;
    size_t operator()(std::string_view id) const { return absl::HashOf(id); }
    size_t operator()(const Sequence* s) const { return absl::HashOf(std::string_view(s->id())); }
    bool operator()(const Sequence* a, const Sequence* b) const { return a->id() == b->id(); }
    bool operator()(const Sequence* a, std::string_view b) const { return a->id() == b; }
    bool operator()(std::string_view a, const Sequence* b) const { return a == b->id(); }
  };
  absl::flat_hash_set<Sequence*, ById, ById> index_;
  std::vector<Holders> holders_;  // [num_pages]
  size_t committed_count_ = 0;
  Sequence* lru_head_ = nullptr;  // least recently used
  Sequence* lru_tail_ = nullptr;  // most recently used
};

}  // namespace mlakv::server
