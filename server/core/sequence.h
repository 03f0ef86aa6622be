// Sequence: one client-chosen id's page table and per-layer lengths.
//
// A page id names the same slot in every layer, so one page list serves all
// layers: page i holds positions [i * page_size, (i + 1) * page_size).
// Plain state; the owning Pool serializes access under its mutex, and the
// SequenceTable links idle committed sequences into its use-order list
// (lru_prev_ / lru_next_, touched only by SequenceTable).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace mlakv::server {

class Sequence;
// The sequences of a pool by id, ordered (paginated listings).
using SequencesById = std::map<std::string, std::unique_ptr<Sequence>, std::less<>>;

class Sequence {
 public:
  Sequence(std::string id, int32_t num_layers) : id_(std::move(id)), layer_lengths_(num_layers, 0) {}
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  const std::string& id() const { return id_; }

  // Page ids in order (kv_indices).
  const std::vector<int32_t>& pages() const { return pages_; }
  std::vector<int32_t>& mutable_pages() { return pages_; }

  // Tokens written in each layer.
  const std::vector<uint32_t>& layer_lengths() const { return layer_lengths_; }
  uint32_t layer_length(int32_t layer) const { return layer_lengths_[layer]; }
  void set_layer_length(int32_t layer, uint32_t length) { layer_lengths_[layer] = length; }
  // Tokens written in every layer (min over layers) / in the longest layer.
  uint32_t length() const { return *std::min_element(layer_lengths_.begin(), layer_lengths_.end()); }
  uint32_t max_length() const { return *std::max_element(layer_lengths_.begin(), layer_lengths_.end()); }
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

 private:
  friend class SequenceTable;

  std::string id_;
  std::vector<int32_t> pages_;
  std::vector<uint32_t> layer_lengths_;  // [num_layers]
  bool busy_ = false;
  bool committed_ = false;
  int64_t last_used_ns_ = 0;
  // Where the table holds this sequence, so that erasing it needs no lookup
  // in a map of a million cold nodes (bench/sequence_scale_bench: 4 us -> 1 us).
  SequencesById::iterator self_;
  // Use-order list of SequenceTable: linked iff committed and not busy.
  Sequence* lru_prev_ = nullptr;
  Sequence* lru_next_ = nullptr;
  bool in_lru_ = false;
};

}  // namespace mlakv::server
