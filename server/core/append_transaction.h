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
#include <optional>
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
  // The first page-table entry the append changed: its first new page, or
  // an earlier shared page it replaced by a private copy (copy-on-write).
  // The views that carry "the pages this call changed" start here.
  size_t first_changed_page() const;
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

  // Where the append's rows end in `layer` (0: none written there).
  uint32_t staged_end(int32_t layer) const { return level_end_ ? *level_end_ : staged_end_[layer]; }
  // The staged ends of every layer, per layer (a level end spread first).
  std::span<const uint32_t> staged_ends();
  // Records rows ending at `end` in every layer / in one layer.
  void StageEveryLayer(uint32_t end);
  void StageLayer(int32_t layer, uint32_t end);
  // Whether the append wrote rows in `layer` (it is then counted in the
  // layer's staged users).
  bool touched(int32_t layer) const { return touched_every_layer() || (!touched_.empty() && touched_[layer] != 0); }
  bool touched_every_layer() const { return touched_layers_ == num_layers_; }
  // Marks `layer` touched; false if it already was.
  bool Touch(int32_t layer);
  // Marks every layer touched; only before any layer is.
  void TouchEveryLayer() { touched_layers_ = num_layers_; }

  // The per-layer arrays below, made on first need (a decode step's 256
  // transactions of 61 layers never need them).
  void MakePerLayer();

  uint32_t num_layers_ = 0;
  // Per layer, in one allocation when made: [staged_end_ | touched_].
  std::vector<uint32_t> per_layer_;
  // The staged ends, in one of two forms: while every message wrote every
  // layer (a decode step, a whole-prompt append) they are the same in all
  // layers and held once in level_end_ (staged_end_ unused), so that Commit
  // raises a level sequence without a pass over its layers; the first
  // message that writes only some layers spreads it into staged_end_ and
  // clears it.
  std::optional<uint32_t> level_end_ = 0;
  std::span<uint32_t> staged_end_;  // [num_layers] end of rows written by the append (0: none)
  // Touched layers, likewise: all of them (touched_layers_ == num_layers_,
  // touched_ possibly not made) or those whose touched_ entry is 1.
  std::span<uint32_t> touched_;
  uint32_t touched_layers_ = 0;     // how many layers are touched
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
