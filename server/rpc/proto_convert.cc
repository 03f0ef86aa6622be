#include "server/rpc/proto_convert.h"

#include <algorithm>
#include <climits>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "kernels/nvfp4_format.h"

namespace mlakv::server {

using format::kCkvDim;
using format::kCkvPackedBytes;
using format::kCkvSfBytes;
using format::kKpeBytes;
using format::kKpeDim;

absl::StatusOr<std::optional<DType>> ToDType(v1::RowDType dtype) {
  switch (dtype) {
    case v1::ROW_DTYPE_UNSPECIFIED: return std::optional<DType>();
    case v1::ROW_DTYPE_FLOAT16: return std::optional<DType>(DType::kFloat16);
    case v1::ROW_DTYPE_BFLOAT16: return std::optional<DType>(DType::kBFloat16);
    default:
      return absl::InvalidArgumentError(absl::StrCat("dtype ", static_cast<int>(dtype),
                                                     " is not a RowDType; use ROW_DTYPE_FLOAT16 or ROW_DTYPE_BFLOAT16"));
  }
}

const char* SmallerViewAdvice(v1::SequenceView view) {
  return view == v1::SEQUENCE_VIEW_FULL
             ? "ask for view SEQUENCE_VIEW_BASIC or COMPACT (only the pages the call allocates) or SEQUENCE_VIEW_LENGTHS "
               "(no page table)"
             : "ask for view SEQUENCE_VIEW_LENGTHS (no page table)";
}

absl::StatusOr<v1::SequenceView> ToView(v1::SequenceView view) {
  switch (view) {
    case v1::SEQUENCE_VIEW_UNSPECIFIED:
    case v1::SEQUENCE_VIEW_FULL: return v1::SEQUENCE_VIEW_FULL;
    case v1::SEQUENCE_VIEW_BASIC: return v1::SEQUENCE_VIEW_BASIC;
    case v1::SEQUENCE_VIEW_COMPACT: return v1::SEQUENCE_VIEW_COMPACT;
    case v1::SEQUENCE_VIEW_LENGTHS: return v1::SEQUENCE_VIEW_LENGTHS;
    case v1::SEQUENCE_VIEW_PACKED: return v1::SEQUENCE_VIEW_PACKED;
    default:
      return absl::InvalidArgumentError(absl::StrCat("view ", static_cast<int>(view),
                                                     " is not a SequenceView; use SEQUENCE_VIEW_FULL, "
                                                     "SEQUENCE_VIEW_BASIC, SEQUENCE_VIEW_COMPACT, SEQUENCE_VIEW_LENGTHS or "
                                                     "SEQUENCE_VIEW_PACKED (AppendBatch only)"));
  }
}

void ToProto(const PoolSnapshot& p, v1::Pool* out) {
  out->set_name(p.name);
  out->set_device(p.device.ToString());
  out->set_format(v1::CACHE_FORMAT_NVFP4_MLA);
  out->set_num_layers(p.num_layers);
  out->set_page_size(p.page_size);
  out->set_pages_total(p.pages_total);
  out->set_pages_free(p.pages_free);
  out->set_pages_used(p.pages_used);
  out->set_sequences(p.sequences);
  out->set_max_sequences(p.max_sequences);
  out->set_bytes_per_token_per_layer(format::kEntryBytes);
  out->set_cache_bytes(p.cache_bytes);
  out->set_ckv_dim(kCkvDim);
  out->set_kpe_dim(kKpeDim);
  out->mutable_layers()->Reserve(static_cast<int>(p.layers.size()));
  for (size_t l = 0; l < p.layers.size(); ++l) {
    v1::LayerScales* ls = out->add_layers();
    ls->set_layer(static_cast<uint32_t>(l));
    ls->set_set(p.layers[l].scales_set);
    ls->set_ckv_scale(p.layers[l].scales_set ? p.layers[l].ckv_scale : 0.0f);
    ls->set_kpe_scale(p.layers[l].scales_set ? p.layers[l].kpe_scale : 0.0f);
    ls->set_tokens(p.layers[l].tokens);
  }
  out->set_pages_shared(static_cast<uint32_t>(p.pages_shared));
  out->set_leases(p.leases);
  out->set_sequences_retained(p.sequences_retained);
  out->set_pages_indexed(p.pages_indexed);
  out->set_eviction(p.eviction_lru ? v1::EVICTION_POLICY_LRU : v1::EVICTION_POLICY_NONE);
  out->set_evictions(p.counters.evictions);
  out->set_evicted_pages(p.counters.evicted_pages);
}

void ToProto(const std::string& pool, const LeaseSnapshot& lease, v1::Lease* out) {
  out->set_pool(pool);
  out->set_lease_id(lease.id);
  out->set_sequence(lease.sequence);
  out->set_generation(lease.generation);
  out->set_holder(lease.holder);
  out->set_tokens(lease.tokens);
  for (int32_t page : lease.pages) out->add_pages(static_cast<uint32_t>(page));
  out->set_expire_time_unix_ms(lease.expire_unix_ms);
  out->set_duration_ms(static_cast<uint32_t>(lease.duration_ms));
  out->set_sequence_freed(lease.sequence_freed);
}

LeaseRequest ToLeaseRequest(const v1::LeaseOptions& options) {
  return LeaseRequest{.holder = options.holder(), .duration = absl::Milliseconds(options.duration_ms())};
}

void ToProto(const std::string& pool, const SequenceSnapshot& s, v1::Sequence* out, v1::SequenceView view,
             size_t first_new_page) {
  if (NamesSequence(view)) {
    out->set_pool(pool);
    out->set_id(s.id);
  }
  out->set_length(s.length);
  // The snapshot holds page-table entries [offset, end); LENGTHS none of them
  // (offset = the pages held, the entry after the last).
  const size_t offset = s.kv_indices_offset, end = offset + s.kv_indices.size();
  const size_t first = !CarriesPages(view) ? end : OnlyNewPages(view) ? std::clamp(first_new_page, offset, end) : offset;
  out->set_kv_indices_offset(static_cast<uint32_t>(first));
  if (first < end) {
    out->mutable_kv_indices()->Reserve(static_cast<int>(end - first));
    for (size_t i = first; i < end; ++i) out->add_kv_indices(static_cast<uint32_t>(s.kv_indices[i - offset]));
  }
  out->set_last_page_len(s.last_page_len);
  if (!OnlyNewPages(view)) {
    for (uint32_t len : s.layer_lengths) out->add_layer_lengths(len);
  }
  out->set_page_size(s.page_size);
  out->set_capacity_tokens(s.capacity_tokens);
  out->set_generation(s.generation);
  out->set_leases(s.leases);
  out->set_pinned(s.pinned);
  out->set_shared_pages(s.shared_pages);
  if (s.lease) ToProto(pool, *s.lease, out->mutable_lease());
}

namespace {

// Bytes of `v` as a protobuf varint.
uint64_t VarintBytes(uint64_t v) {
  uint64_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

}  // namespace

void AddPacked(const SequenceSnapshot& s, size_t first_new_page, v1::PackedSequences* out) {
  const size_t offset = s.kv_indices_offset, end = offset + s.kv_indices.size();
  const size_t first = std::clamp(first_new_page, offset, end);
  out->add_lengths(s.length);
  out->add_kv_indices_offsets(static_cast<uint32_t>(first));
  out->add_new_page_counts(static_cast<uint32_t>(end - first));
  out->add_generations(s.generation);
  for (size_t i = first; i < end; ++i) out->add_new_pages(static_cast<uint32_t>(s.kv_indices[i - offset]));
}

void AddBatchSequences(const std::string& pool, std::span<const SequenceSnapshot> after,
                       std::span<const size_t> first_new, uint32_t new_pages, v1::SequenceView view,
                       const std::string& server_id, v1::AppendBatchResponse* resp) {
  if (view == v1::SEQUENCE_VIEW_PACKED) {  // one message of parallel arrays
    v1::PackedSequences* out = resp->mutable_packed();
    const int n = static_cast<int>(after.size());
    out->mutable_lengths()->Reserve(n);
    out->mutable_kv_indices_offsets()->Reserve(n);
    out->mutable_new_page_counts()->Reserve(n);
    out->mutable_generations()->Reserve(n);
    out->mutable_new_pages()->Reserve(static_cast<int>(new_pages));
    for (size_t i = 0; i < after.size(); ++i) AddPacked(after[i], first_new[i], out);
    return;
  }
  resp->mutable_sequences()->Reserve(static_cast<int>(after.size()));
  for (size_t i = 0; i < after.size(); ++i) {
    v1::Sequence* out = resp->add_sequences();
    ToProto(pool, after[i], out, view, first_new[i]);
    if (NamesSequence(view)) out->set_server_id(server_id);
  }
}

uint64_t PackedSequenceBytesBound(size_t new_pages, uint32_t num_pages) {
  // Four varints of at most 5 bytes (10 for the generation), and each new
  // page's id below num_pages.
  return 5 + 5 + 5 + 10 + VarintBytes(num_pages == 0 ? 0 : num_pages - 1) * static_cast<uint64_t>(new_pages);
}

uint64_t SequenceProtoBytesBound(size_t id_bytes, size_t pool_bytes, size_t pages, uint32_t num_pages, size_t layers) {
  // Strings and packed fields: a tag, a length varint and the bytes; the
  // scalar fields at most a tag and 5 bytes each (the 64-bit generation
  // 11); the enclosing message's own tag and length 6 more. (No lease: an
  // append's response carries none.) Page ids are below num_pages, lengths below 2^31.
  const uint64_t page_id = VarintBytes(num_pages == 0 ? 0 : num_pages - 1);
  const uint64_t page_ids = page_id * pages, lengths = 5 * static_cast<uint64_t>(layers);
  const uint64_t server_id = 1 + 2 + kMaxServerIdBytes;
  return (1 + VarintBytes(pool_bytes) + pool_bytes) + (1 + VarintBytes(id_bytes) + id_bytes) +
         (1 + VarintBytes(page_ids) + page_ids) + (1 + VarintBytes(lengths) + lengths) + 6 * 6 + 11 + 6 + 2 + 6 + 6 +
         server_id;
}

namespace {

// Bytes in pieces as the registry takes them: one piece (or none) as a
// plain view, several as the pieces.
void SetBytes(const BytePieces& pieces, absl::string_view* view, const BytePieces** many) {
  if (pieces.parts.size() > 1) {
    *many = &pieces;
  } else if (pieces.parts.size() == 1) {
    *view = absl::string_view(pieces.parts[0].data(), pieces.parts[0].size());
  }
}

// `lr` as the registry takes it; `pieces`: its rows, when the message was
// parsed leaving them in its slices (server/rpc/append_wire.h).
LayerRowsRequest ToLayerRowsRequest(const v1::LayerRows& lr, const LayerPieces* pieces = nullptr) {
  LayerRowsRequest in{.layer = static_cast<int32_t>(std::min<uint32_t>(lr.layer(), INT32_MAX)),
                      .ckv = lr.ckv(),
                      .kpe = lr.kpe(),
                      .ckv_scale = lr.ckv_scale(),
                      .kpe_scale = lr.kpe_scale()};
  if (pieces != nullptr) {
    SetBytes(pieces->ckv, &in.ckv, &in.ckv_pieces);
    SetBytes(pieces->kpe, &in.kpe, &in.kpe_pieces);
  }
  if (lr.has_ckv_ref()) in.ckv_ref = RegionRef{lr.ckv_ref().region(), lr.ckv_ref().offset(), lr.ckv_ref().row_stride_bytes()};
  if (lr.has_kpe_ref()) in.kpe_ref = RegionRef{lr.kpe_ref().region(), lr.kpe_ref().offset(), lr.kpe_ref().row_stride_bytes()};
  return in;
}

}  // namespace

absl::StatusOr<SequenceRowsIn> ToRows(const std::string& sequence, uint32_t start, uint32_t row_count,
                                      const google::protobuf::RepeatedPtrField<v1::LayerRows>& layers,
                                      uint32_t reserve_tokens, std::optional<uint32_t> expect_length,
                                      const RegionRegistry& regions, const Pool& pool, RegionHold* hold,
                                      std::span<const LayerPieces> pieces) {
  if (!pieces.empty() && pieces.size() != static_cast<size_t>(layers.size())) {
    return absl::InternalError("append: rows in pieces for another number of layers (a server bug)");
  }
  if (layers.size() > pool.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("sequence ", Quote(sequence), ": ", layers.size(),
                                                   " LayerRows entries but pool ", Quote(pool.name()), " has ",
                                                   pool.num_layers(), " layers; send one entry per layer"));
  }
  SequenceRowsIn r;
  r.start = start;
  r.row_count = row_count;
  r.reserve_tokens = reserve_tokens;
  r.expect_length = expect_length;
  r.layers.reserve(layers.size());
  for (int i = 0; i < layers.size(); ++i) {
    const v1::LayerRows& lr = layers[i];
    LayerRows out;
    MLAKV_RETURN_IF_ERROR(regions.ResolveRows([&] { return absl::StrCat("sequence ", Quote(sequence), " layer ", lr.layer()); },
                                              ToLayerRowsRequest(lr, pieces.empty() ? nullptr : &pieces[i]),
                                              row_count, pool.device(), &out, hold));
    r.layers.push_back(out);
  }
  return r;
}

absl::Status ToCompactBatchRows(const ReceivedAppendBatch& received, const RegionRegistry& regions, const Pool& pool,
                                RegionHold* hold, CompactBatchRows* out) {
  const v1::AppendBatchRequest& req = received.message;
  constexpr uint64_t kCkvRow = format::kCkvDim * 2, kKpeRow = format::kKpeDim * 2;
  if (req.batch_layers_size() > pool.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(req.batch_layers_size(), " batch_layers entries but pool ",
                                                   Quote(pool.name()), " has ", pool.num_layers(),
                                                   " layers; send one entry per layer"));
  }
  uint64_t total = 0;
  for (const v1::SequenceRows& s : req.sequences()) {
    if (s.layers_size() > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence ", Quote(s.sequence()), " carries ", s.layers_size(),
          " layers entries in an AppendBatch that uses batch_layers; send every sequence's rows one way"));
    }
    total += s.row_count();
  }
  if (total > static_cast<uint64_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat("the batch's row_count values sum to ", total,
                                                   " rows per layer, over 2^31 - 1; send fewer rows per call"));
  }
  std::vector<LayerRows>& whole = out->layers;
  whole.assign(req.batch_layers_size(), {});
  for (int k = 0; k < req.batch_layers_size(); ++k) {
    const v1::LayerRows& lr = req.batch_layers(k);
    const auto who = [&] { return absl::StrCat("batch_layers[", k, "] (layer ", lr.layer(), ")"); };  // for errors
    MLAKV_RETURN_IF_ERROR(regions.ResolveRows(who, ToLayerRowsRequest(lr, received.batch_pieces(k)),
                                              static_cast<uint32_t>(total), pool.device(), &whole[k], hold));
    if (whole[k].ckv_bytes != total * kCkvRow || whole[k].kpe_bytes != total * kKpeRow) {
      return absl::InvalidArgumentError(absl::StrCat(
          who(), ": holds ", whole[k].ckv_bytes, " ckv and ", whole[k].kpe_bytes, " kpe bytes; the batch's ", total,
          " rows (the sum of its row_count values) need ", total * kCkvRow, " and ", total * kKpeRow));
    }
  }
  out->sequences.assign(req.sequences_size(), {});
  uint64_t first = 0;
  for (int i = 0; i < req.sequences_size(); ++i) {
    const v1::SequenceRows& s = req.sequences(i);
    SequenceRowsIn& r = out->sequences[i];
    r.start = s.start();
    r.row_count = s.row_count();
    if (s.has_expect_length()) r.expect_length = s.expect_length();
    r.shared_layers = whole;
    r.shared_first = first;
    AddCacheFields(s, &r);
    first += s.row_count();
  }
  return absl::OkStatus();
}

v1::Region ToProto(const RegionInfo& region) {
  v1::Region out;
  out.set_name(region.name);
  out.set_byte_size(region.byte_size);
  out.set_appends_in_flight(region.appends_in_flight);
  if (region.kind == Region::Kind::kShm) {
    out.set_kind(v1::REGION_KIND_SHM);
    out.set_shm_name(region.shm_name);
    out.set_shm_offset(region.shm_offset);
  } else {
    out.set_kind(v1::REGION_KIND_CUDA);
    out.set_device_id(region.device);
    out.set_has_event(region.has_event);
  }
  return out;
}

}  // namespace mlakv::server
