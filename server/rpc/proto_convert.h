// Conversions between the wire (mlakv.v1 protos) and the core model (Pool's
// snapshots and row views), in one place.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "mlakv/v1/kv_cache.pb.h"
#include "server/rpc/append_wire.h"
#include "server/core/pool.h"
#include "server/regions/region_registry.h"

namespace mlakv::server {

// UNSPECIFIED -> nullopt (refused by Pool::Stage when rows come); values
// outside the enum -> INVALID_ARGUMENT.
absl::StatusOr<std::optional<DType>> ToDType(v1::RowDType dtype);

// INVALID_ARGUMENT for a value outside the enum; UNSPECIFIED -> FULL.
absl::StatusOr<v1::SequenceView> ToView(v1::SequenceView view);

// What a view (as ToView returns it) carries: only the pages the call
// allocated (BASIC, COMPACT, PACKED), no page table (LENGTHS), the per-layer
// lengths (FULL only), and the names (pool, id, server_id; not COMPACT,
// LENGTHS or PACKED). PACKED is answered by AddPacked, not ToProto.
inline bool OnlyNewPages(v1::SequenceView view) { return view != v1::SEQUENCE_VIEW_FULL; }
inline bool CarriesPages(v1::SequenceView view) { return view != v1::SEQUENCE_VIEW_LENGTHS; }
inline bool NamesSequence(v1::SequenceView view) {
  return view != v1::SEQUENCE_VIEW_COMPACT && view != v1::SEQUENCE_VIEW_LENGTHS && view != v1::SEQUENCE_VIEW_PACKED;
}
// Page ids a response in `view` carries for a sequence of `pages` pages of
// which the call allocated `allocated`.
inline size_t PagesDescribed(v1::SequenceView view, size_t pages, size_t allocated) {
  return !CarriesPages(view) ? 0 : OnlyNewPages(view) ? allocated : pages;
}
// What to ask for instead when a response in `view` would pass the send
// limit: "ask for view ..." naming the views that carry fewer page ids.
const char* SmallerViewAdvice(v1::SequenceView view);
// What an append's commit snapshots for a response in `view`.
inline SnapshotPages SnapshotPagesFor(v1::SequenceView view) {
  return !CarriesPages(view) ? SnapshotPages::kNone : OnlyNewPages(view) ? SnapshotPages::kNew : SnapshotPages::kAll;
}

void ToProto(const PoolSnapshot& p, v1::Pool* out);

// `view` FULL: every page; BASIC: only page table entries from
// `first_new_page` on (the pages an append allocated), no per-layer lengths;
// COMPACT: BASIC without pool and id; LENGTHS: COMPACT without the page
// table (kv_indices_offset = the pages held).
void ToProto(const std::string& pool, const SequenceSnapshot& s, v1::Sequence* out,
             v1::SequenceView view = v1::SEQUENCE_VIEW_FULL, size_t first_new_page = 0);

// Longest --server_id (it is in every Sequence message).
inline constexpr size_t kMaxServerIdBytes = 256;

// An upper bound of the serialized size of a Sequence message holding
// `pages` page ids below `num_pages` and `layers` lengths below 2^31, whose
// id and pool name have those byte counts (for refusing, before a commit, a
// response over the send limit).
uint64_t SequenceProtoBytesBound(size_t id_bytes, size_t pool_bytes, size_t pages, uint32_t num_pages, size_t layers);

// One sequence's entries in a PackedSequences message (SEQUENCE_VIEW_PACKED):
// its length, new pages' offset and count, generation, and the pages the
// call allocated (those from `first_new_page` on), appended to `out`.
void AddPacked(const SequenceSnapshot& s, size_t first_new_page, v1::PackedSequences* out);
// An AppendBatch's committed sequences into `resp` in `view`: one
// PackedSequences message (PACKED; its arrays reserved once, `new_pages`
// page ids in all) or a Sequence each (ToProto; with `server_id` where the
// view names the sequence). `first_new[i]`: the pages sequence i held
// before the call.
void AddBatchSequences(const std::string& pool, std::span<const SequenceSnapshot> after,
                       std::span<const size_t> first_new, uint32_t new_pages, v1::SequenceView view,
                       const std::string& server_id, v1::AppendBatchResponse* resp);
// At most how many bytes one sequence adds to a PackedSequences message with
// `new_pages` new pages below `num_pages`, its arrays' tags and lengths
// counted apart (PackedSequencesFixedBytes).
uint64_t PackedSequenceBytesBound(size_t new_pages, uint32_t num_pages);
// The tags and length varints of a PackedSequences message's five arrays and
// of the message itself inside AppendBatchResponse, at most.
inline constexpr uint64_t kPackedSequencesFixedBytes = 6 * (1 + 5);

void ToProto(const std::string& pool, const LeaseSnapshot& lease, v1::Lease* out);

// A LeaseOptions message as the pool takes it.
LeaseRequest ToLeaseRequest(const v1::LeaseOptions& options);

// The cache-management fields an AppendRequest or SequenceRows carries
// (expect_generation, block hashes).
template <typename Message>
void AddCacheFields(const Message& m, SequenceRowsIn* rows) {
  if (m.has_expect_generation()) rows->expect_generation = m.expect_generation();
  rows->block_hashes.assign(m.block_hashes().begin(), m.block_hashes().end());
  rows->block_hashes_first_page = m.block_hashes_first_page();
}

// The sequence a request names: `sequence`, pinned to `expect_generation` if set.
template <typename Request>
SequenceRef RefOf(const Request& req) {
  SequenceRef ref(req.sequence());
  if (req.has_expect_generation()) ref.expect_generation = req.expect_generation();
  return ref;
}

// The rows of AppendBatchRequest's compact form: each `batch_layers` entry
// resolved once (bytes, or its region ranges) into `layers`, checked to hold
// exactly sum(row_count) rows; one SequenceRowsIn per `sequences` entry (none
// may carry `layers`) naming its row offset in them (shared_layers). The
// sequences point into `layers`: keep the struct whole (moving it is fine,
// the vectors keep their storage; copying it is not). Bytes rows are read
// where the request left them (its pieces, or its message), which must
// outlive the struct.
struct CompactBatchRows {
  std::vector<LayerRows> layers;
  std::vector<SequenceRowsIn> sequences;
  CompactBatchRows() = default;
  CompactBatchRows(const CompactBatchRows&) = delete;
  CompactBatchRows& operator=(const CompactBatchRows&) = delete;
  CompactBatchRows(CompactBatchRows&&) = default;
  CompactBatchRows& operator=(CompactBatchRows&&) = default;
};
absl::Status ToCompactBatchRows(const ReceivedAppendBatch& received, const RegionRegistry& regions, const Pool& pool,
                                RegionHold* hold, CompactBatchRows* out);

// A registered region as the wire describes it.
v1::Region ToProto(const RegionInfo& region);

// The rows of one sequence as Pool::Stage takes them: LayerRows' bytes, or
// the rows their RegionRefs name (resolved by `regions`; `hold` keeps them
// valid while the append is in flight). `pieces`, when not empty: layers[i]'s
// bytes are pieces[i] (a message parsed leaving its rows in the slices it
// arrived in, server/rpc/append_wire.h; they outlive the append's staging).
absl::StatusOr<SequenceRowsIn> ToRows(const std::string& sequence, uint32_t start, uint32_t row_count,
                                      const google::protobuf::RepeatedPtrField<v1::LayerRows>& layers,
                                      uint32_t reserve_tokens, std::optional<uint32_t> expect_length,
                                      const RegionRegistry& regions, const Pool& pool, RegionHold* hold,
                                      std::span<const LayerPieces> pieces = {});

}  // namespace mlakv::server
