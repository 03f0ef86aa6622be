// Sequence: one client-chosen id's page table, per-layer lengths and the
// cache-management state that goes with one incarnation of the id.
//
// A page id names the same slot in every layer, so one page list serves all
// layers: page i holds positions [i * page_size, (i + 1) * page_size).
// Plain state; the owning Pool serializes access under its mutex, and the
// SequenceTable links the sequences that may be reaped or evicted into its
// use-order list (lru_prev_ / lru_next_, touched only by SequenceTable).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

namespace mlakv::server {

class Sequence;
// The sequences of a pool by id, ordered (paginated listings).
using SequencesById = std::map<std::string, std::unique_ptr<Sequence>, std::less<>>;

class Sequence {
 public:
  Sequence(std::string id, int32_t num_layers, uint64_t generation)
      : id_(std::move(id)), generation_(generation), layer_lengths_(num_layers, 0) {}
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  const std::string& id() const { return id_; }
  // This incarnation of the id (server/core/ids.h): never reused.
  uint64_t generation() const { return generation_; }

  // Page ids in order (kv_indices). Changed only through SequenceTable,
  // which keeps the page -> holders index in step.
  const std::vector<int32_t>& pages() const { return pages_; }

  // Tokens written in each layer.
  const std::vector<uint32_t>& layer_lengths() const { return layer_lengths_; }
  uint32_t layer_length(int32_t layer) const { return layer_lengths_[layer]; }
  // Tokens written in every layer (min over layers) / in the longest layer:
  // kept by every change of the lengths (LengthsEdit), since a commit reads
  // them four times per sequence (events, prefix index, snapshot, empty()).
  uint32_t length() const { return min_length_; }
  uint32_t max_length() const { return max_length_; }

  // The way to change layers' lengths (besides an append's RaiseLengths):
  // write them through the edit; its end recomputes length() and
  // max_length() in one pass.
  class LengthsEdit {
   public:
    explicit LengthsEdit(Sequence& seq) : seq_(seq) {}
    LengthsEdit(const LengthsEdit&) = delete;
    LengthsEdit& operator=(const LengthsEdit&) = delete;
    ~LengthsEdit() { seq_.RecomputeLengthBounds(); }
    uint32_t& operator[](size_t layer) { return seq_.layer_lengths_[layer]; }
    size_t size() const { return seq_.layer_lengths_.size(); }

   private:
    Sequence& seq_;
  };
  LengthsEdit EditLayerLengths() { return LengthsEdit(*this); }
  // An append's commit, the other way: each layer's length becomes the
  // larger of it and `staged_end[layer]` (0: the append did not write the
  // layer), each layer's growth is added to `growth[layer]`, and length() /
  // max_length() come from the same pass -- one branch-free pass over
  // contiguous arrays instead of two (a decode step commits 256 sequences x
  // 61 layers).
  void RaiseLengths(std::span<const uint32_t> staged_end, std::span<uint64_t> growth) {
    uint32_t lo = layer_lengths_.empty() ? 0 : UINT32_MAX, hi = 0;
    for (size_t l = 0; l < layer_lengths_.size(); ++l) {
      const uint32_t before = layer_lengths_[l];
      const uint32_t after = std::max(before, staged_end[l]);
      growth[l] += after - before;
      layer_lengths_[l] = after;
      lo = std::min(lo, after);
      hi = std::max(hi, after);
    }
    min_length_ = lo;
    max_length_ = hi;
  }
  // RaiseLengths for a sequence whose layers are level (length() ==
  // max_length()) and rows ending at `end` in every layer: the layers all
  // become max(length(), end) in one fill. Returns each layer's growth.
  uint32_t RaiseLevelLengths(uint32_t end) {
    if (end <= min_length_) return 0;
    const uint32_t growth = end - min_length_;
    std::fill(layer_lengths_.begin(), layer_lengths_.end(), end);
    min_length_ = max_length_ = end;
    return growth;
  }
  // Holds no page and no token (then it must not stay in the table).
  bool empty() const { return pages_.empty() && max_length() == 0; }

  // Entries of page `page_index` filled in `layer` (0..page_size).
  uint32_t FilledInPage(int32_t layer, uint32_t page_index, uint32_t page_size) const {
    const uint64_t first = static_cast<uint64_t>(page_index) * page_size;
    const uint64_t len = layer_lengths_[layer];
    return len <= first ? 0 : static_cast<uint32_t>(std::min<uint64_t>(len - first, page_size));
  }

  // When the sequence was last appended to, read, truncated or queried by id
  // (nanoseconds since the Unix epoch). Set by SequenceTable::Touch, which
  // also moves it to the most recent end of the use-order list.
  int64_t last_used_ns() const { return last_used_ns_; }

  // True while an append holds the sequence exclusively (see docs/server.md).
  bool busy() const { return busy_; }
  // False until the first append to a new id commits: until then the sequence
  // is invisible to queries and an aborted first append erases it.
  bool committed() const { return committed_; }
  // Created pinned: never evicted, never freed by the idle TTL.
  bool pinned() const { return pinned_; }
  // Freed while leased: gone from the table, kept only for its leases.
  bool retained() const { return retained_; }

  // Leases alive on this incarnation, by the tokens each protects.
  const std::multiset<uint32_t>& lease_tokens() const { return lease_tokens_; }
  // Tokens [0, protected_tokens()) of every layer no call may change.
  uint32_t protected_tokens() const { return lease_tokens_.empty() ? 0 : *lease_tokens_.rbegin(); }

  // While an append is in flight: the lowest committed position it has
  // rewritten so far (UINT32_MAX: none), so that a lease may still be taken
  // on the tokens below it.
  uint32_t rewrite_floor() const { return rewrite_floor_; }
  void set_rewrite_floor(uint32_t position) { rewrite_floor_ = position; }

  // True while an in-flight append has copied a shared page of this
  // sequence (the page table names the copy until Commit or Abort).
  bool cow_in_flight() const { return cow_in_flight_; }
  void set_cow_in_flight(bool v) { cow_in_flight_ = v; }
  // References to pages this sequence's page table no longer names (a
  // copy-on-write replaced them) that hold tokens its leases protect: a
  // reader attending from the page table it leased keeps finding them. Held
  // until the last lease ends.
  std::vector<int32_t>& lease_held_pages() { return lease_held_pages_; }
  const std::vector<int32_t>& lease_held_pages() const { return lease_held_pages_; }

  // Block hashes the client gave for pages not yet complete in every layer
  // (page index -> hash); indexed by the pool once they are.
  std::map<uint32_t, std::string>& pending_hashes() { return pending_hashes_; }
  // Page-table entries below this are announced stored or shared with a
  // holder that announced them (KV events); the next scan starts here.
  uint32_t pages_announced() const { return pages_announced_; }
  void set_pages_announced(uint32_t n) { pages_announced_ = n; }

 private:
  friend class SequenceTable;
  void RecomputeLengthBounds() {
    uint32_t lo = layer_lengths_.empty() ? 0 : UINT32_MAX, hi = 0;
    for (const uint32_t len : layer_lengths_) {
      lo = std::min(lo, len);
      hi = std::max(hi, len);
    }
    min_length_ = lo;
    max_length_ = hi;
  }

  std::string id_;
  uint64_t generation_ = 0;
  std::vector<int32_t> pages_;
  // owner_slot_[i]: where this sequence sits in the holder list of pages_[i]
  // (SequenceTable), so that dropping one holder of a page shared by many
  // is O(1).
  std::vector<uint32_t> owner_slot_;
  std::vector<uint32_t> layer_lengths_;  // [num_layers]
  uint32_t min_length_ = 0, max_length_ = 0;  // of layer_lengths_ (LengthsEdit keeps them)
  bool busy_ = false;
  bool committed_ = false;
  bool pinned_ = false;
  bool retained_ = false;
  std::multiset<uint32_t> lease_tokens_;
  std::map<uint32_t, std::string> pending_hashes_;
  uint32_t pages_announced_ = 0;
  uint32_t rewrite_floor_ = UINT32_MAX;
  bool cow_in_flight_ = false;
  std::vector<int32_t> lease_held_pages_;
  int64_t last_used_ns_ = 0;
  // Where the table holds this sequence, so that erasing it needs no lookup
  // in a map of a million cold nodes (bench/sequence_scale_bench: 4 us -> 1 us).
  SequencesById::iterator self_;
  // Use-order list of SequenceTable: linked iff reapable (ReapableNow).
  Sequence* lru_prev_ = nullptr;
  Sequence* lru_next_ = nullptr;
  bool in_lru_ = false;
};

}  // namespace mlakv::server
