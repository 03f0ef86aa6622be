// AppendTransaction: the state of one in-flight append to one sequence, from
// Pool::BeginAppend to Pool::Commit or Pool::Abort.
//
// How an append stays atomic (docs/server.md "Atomicity"):
//  * rows are quantized straight into the sequence's pages as messages
//    arrive, but the per-layer lengths only move at Commit, so rows past a
//    layer's committed length stay invisible until then;
//  * before a message rewrites positions below the committed length, the
//    stored bytes of those positions are copied into `undo` (once per
//    position), and Abort writes them back;
//  * pages allocated by the append are appended to the page table and cut
//    off again (returned to the allocator) by Abort; a sequence created by
//    the append is erased by Abort;
//  * scales the append set on an empty layer are unset again by Abort if the
//    layer still stores nothing;
//  * a page the append writes that has another reference (a fork, a page
//    lease) is copied first to a new page, which takes its place in the page
//    table; the append keeps the old page's reference until Commit drops it,
//    and Abort puts the old page back (copy-on-write).
// The sequence is held exclusively (Sequence::busy) for the whole append.
// Only Pool touches the fields.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "server/core/sequence.h"

namespace mlakv::server {

class Pool;

class AppendTransaction {
 public:
  AppendTransaction(const AppendTransaction&) = delete;
  AppendTransaction& operator=(const AppendTransaction&) = delete;
  // A transaction is always committed or aborted by its owner; one that is
  // not is aborted here (and logged as a bug).
  ~AppendTransaction();

  const std::string& sequence_id() const { return id_; }
  // Rows written so far, summed over layers and messages.
  uint64_t rows_written() const { return rows_written_; }
  // Pages allocated so far by this append.
  uint32_t pages_allocated() const { return pages_allocated_; }
  // Pages the sequence held before the append (its new pages follow them in
  // the page table).
  size_t original_pages() const { return original_pages_; }
  bool finished() const { return finished_; }

 private:
  friend class Pool;

  struct LayerScalesBefore {
    int32_t layer = 0;
    bool set = false;
    float ckv_scale = 0.0f;
    float kpe_scale = 0.0f;
  };
  struct Undo {
    int32_t layer = 0;
    std::vector<int64_t> entries;  // cache entries whose old bytes are saved
    std::vector<uint8_t> ckv_packed, ckv_sf, kpe;
    bool captured = false;  // bytes were read (only then are they restored)
  };

  AppendTransaction(Pool* pool, Sequence* sequence, std::string id, int32_t num_layers);

  Pool* pool_;
  Sequence* sequence_;
  std::string id_;
  bool created_ = false;             // the append created the sequence
  size_t original_pages_ = 0;        // page-table length before the append
  // The lengths before the append are the sequence's own: it is held busy
  // for the whole append, and nothing but this append's Commit changes a busy
  // sequence's lengths (a truncate, free, fork into it or eviction is
  // refused or skips it). The least and the most of them are kept by the
  // sequence: a decode step's rows start where every layer ends, so
  // Pool::CheckState and PlanPages settle "no hole", "no rewrite" and
  // expect_length from those two instead of a pass over layers.
  uint32_t committed(int32_t layer) const { return sequence_->layer_length(layer); }
  uint32_t committed_min() const { return sequence_->length(); }
  uint32_t committed_max() const { return sequence_->max_length(); }

  // Per layer, in one allocation (a decode step begins 256 transactions of
  // 61 layers): [staged_end_ | touched_].
  std::vector<uint32_t> per_layer_;
  std::span<uint32_t> staged_end_;  // [num_layers] end of rows written by the append (0: none)
  std::span<uint32_t> touched_;     // [num_layers] 1: the append wrote rows here (counted in staged_users)
  uint32_t touched_layers_ = 0;     // how many touched_ entries are 1 (all: Commit takes one pass without branches)
  std::vector<std::vector<bool>> saved_;  // [num_layers][committed(layer)] position's old bytes are in undo_ (empty until a rewrite)
  std::vector<Undo> undo_;
  std::vector<LayerScalesBefore> scales_before_;  // layers whose scales this append set
  struct CopyOnWrite {
    size_t index = 0;   // page-table entry
    int32_t from = 0;   // the shared page (its reference held until Commit)
    int32_t to = 0;     // the private copy now in the table
  };
  std::vector<CopyOnWrite> cows_;
  struct PageRange {
    uint32_t first = 0, last = 0;  // page-table entries [first, last)
  };
  std::vector<PageRange> rewritten_pages_;    // entries holding rewritten committed positions, per message
  std::map<uint32_t, std::string> hashes_;    // block hashes to record at Commit
  bool pin_ = false;
  uint64_t rows_written_ = 0;
  uint32_t pages_allocated_ = 0;
  bool finished_ = false;
};

}  // namespace mlakv::server
