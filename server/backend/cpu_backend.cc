#include "server/backend/cpu_backend.h"

#include <array>
#include <deque>
#include <optional>
#include <string>
#include <limits>

#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/nvfp4_format.h"
#include "kernels/quantize_append.h"

namespace mlakv::server {
namespace {

using format::kCkvDim;
using format::kCkvPackedBytes;
using format::kCkvSfBytes;
using format::kKpeBytes;
using format::kKpeDim;

int64_t Entries(const CacheBackend::Geometry& g) { return static_cast<int64_t>(g.num_pages) * g.page_size; }

// The first `bytes` bytes of host rows of ckv (or kpe) in one buffer of
// 2-byte elements: where they are, or a copy kept in `gathered` for rows in
// pieces (the kernel reads packed rows from one pointer) and for rows at an
// odd address (an Append message's rows lie in gRPC's slices wherever the
// wire put them; the kernel loads uint16_t elements).
const void* HostRows(const RowSource& rows, bool ckv, uint64_t bytes, std::deque<std::string>* gathered) {
  const void* at = ckv ? rows.ckv : rows.kpe;
  if ((ckv ? rows.ckv_pieces : rows.kpe_pieces) == nullptr && reinterpret_cast<uintptr_t>(at) % 2 == 0) return at;
  std::string& out = gathered->emplace_back();
  out.reserve(static_cast<size_t>(bytes));
  ForEachHostRun(rows, ckv, bytes, [&](const char* data, size_t n) { out.append(data, n); });
  return out.data();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(const Options& options) {
  const Geometry& g = options.geometry;
  if (g.num_layers < 1 || g.num_pages < 1 || g.page_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("cpu backend: num_layers, num_pages and page_size must be >= 1, got ",
                                                   g.num_layers, ", ", g.num_pages, ", ", g.page_size));
  }
  std::unique_ptr<CpuBackend> backend(new CpuBackend(options));
  if (backend->options_.num_threads <= 0) {
    backend->options_.num_threads = std::max(1u, std::thread::hardware_concurrency());
  }
  const int64_t entries = Entries(g);
  for (int32_t l = 0; l < g.num_layers; ++l) {
    // calloc: zeroed, and the OS maps pages lazily, so an idle pool costs little.
    LayerCaches c;
    c.ckv = static_cast<uint8_t*>(std::calloc(entries, kCkvPackedBytes));
    c.sf = static_cast<uint8_t*>(std::calloc(entries, kCkvSfBytes));
    c.kpe = static_cast<uint8_t*>(std::calloc(entries, kKpeBytes));
    backend->layers_.push_back(c);
    if (c.ckv == nullptr || c.sf == nullptr || c.kpe == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cpu backend: allocating ", backend->cache_bytes(),
                                                       " bytes of host memory for ", g.num_layers,
                                                       " layers failed at layer ", l));
    }
  }
  return backend;
}

CpuBackend::~CpuBackend() {
  for (LayerCaches& c : layers_) {
    std::free(c.ckv);
    std::free(c.sf);
    std::free(c.kpe);
  }
}

uint64_t CpuBackend::cache_bytes() const {
  return static_cast<uint64_t>(Entries(options_.geometry)) * format::kEntryBytes *
         options_.geometry.num_layers;
}

absl::Status CpuBackend::Append(std::span<const LayerAppend> layers) {
  const Geometry& g = options_.geometry;
  // Per (layer, segment): params over that segment's rows (each segment's
  // rows are their own host buffer). Placement is validated once per layer,
  // over all its segments together (O(requests + segments + pages); per
  // segment it would re-check the whole page table each time), and for every
  // layer before anything is written.
  std::vector<QuantizeAppendParams> all;
  // One segment per params: {indptr 0, rows, request, start}.
  std::vector<std::array<int32_t, 4>> placements;
  std::vector<int32_t> layer_indptr, layer_request, layer_start;
  std::deque<std::string> gathered;  // rows in pieces, copied together for the kernel
  for (const LayerAppend& la : layers) {
    if (la.layer < 0 || la.layer >= g.num_layers) {
      return absl::InternalError(absl::StrCat("cpu backend: layer ", la.layer, " outside [0, ", g.num_layers, ")"));
    }
    const LayerCaches& c = layers_[la.layer];
    const QuantizeAppendParams p = LayerParams(la, g, c.ckv, c.sf, c.kpe);
    if (!CheckDecodeScale(p.ckv_scale, "ckv_scale").ok() || !CheckDecodeScale(p.kpe_scale, "kpe_scale").ok()) {
      return absl::InternalError("cpu backend: scales not positive normal (a server bug)");
    }
    layer_indptr.assign(1, 0);
    layer_request.clear();
    layer_start.clear();
    if (la.rows && la.rows->on_device()) {
      return absl::InternalError("cpu backend: rows in device memory (the region registry refuses them; a bug)");
    }
    // Rows of every segment in one run of the layer (la.rows: a compact
    // AppendBatch's entry) that are in pieces: gathered once for the layer,
    // then read per segment from there, instead of a gather per segment (a
    // decode step's 61 layers x 256 sequences).
    std::optional<RowSource> layer_rows;
    if (la.rows && (la.rows->ckv_pieces != nullptr || la.rows->kpe_pieces != nullptr)) {
      uint64_t n = 0;
      for (const AppendSegment& seg : la.segments) n += static_cast<uint64_t>(std::max<int32_t>(seg.count, 0));
      const uint64_t esize = DTypeSize(la.dtype);
      layer_rows = RowSource{.ckv = HostRows(*la.rows, true, n * kCkvDim * esize, &gathered),
                             .kpe = HostRows(*la.rows, false, n * kKpeDim * esize, &gathered)};
    }
    for (const AppendSegment& seg : la.segments) {
      if (seg.count <= 0) continue;
      const RowSource rows = layer_rows
                                 ? layer_rows->From(static_cast<uint64_t>(layer_indptr.back()), DTypeSize(la.dtype))
                                 : SegmentRows(la, seg, layer_indptr.back());
      if (rows.on_device()) {
        return absl::InternalError("cpu backend: rows in device memory (the region registry refuses them; a bug)");
      }
      if (static_cast<int64_t>(layer_indptr.back()) + seg.count > std::numeric_limits<int32_t>::max()) {
        return absl::InternalError("cpu backend: more than 2^31 rows in one layer");
      }
      layer_indptr.push_back(layer_indptr.back() + seg.count);
      layer_request.push_back(seg.request);
      layer_start.push_back(seg.start);
      QuantizeAppendParams one = p;
      one.append_ckv = HostRows(rows, true, seg.count * kCkvDim * DTypeSize(la.dtype), &gathered);
      one.append_kpe = HostRows(rows, false, seg.count * kKpeDim * DTypeSize(la.dtype), &gathered);
      one.num_rows = seg.count;
      placements.push_back({0, seg.count, seg.request, seg.start});
      all.push_back(one);
    }
    if (layer_request.empty()) continue;
    QuantizeAppendParams whole = p;  // the layer's placement only; no rows are read
    whole.num_rows = layer_indptr.back();
    whole.segment_indptr = layer_indptr.data();
    whole.segment_request = layer_request.data();
    whole.segment_start = layer_start.data();
    whole.num_segments = static_cast<int32_t>(layer_request.size());
    if (absl::Status s = ValidateRowPlacement(whole); !s.ok()) {
      return absl::InternalError(absl::StrCat("cpu backend: row placement rejected (a server bug): ", s.message()));
    }
  }
  // `placements` no longer reallocates: point the params at it now.
  for (size_t i = 0; i < all.size(); ++i) {
    all[i].segment_indptr = &placements[i][0];
    all[i].segment_request = &placements[i][2];
    all[i].segment_start = &placements[i][3];
    all[i].num_segments = 1;
  }
  for (const QuantizeAppendParams& p : all) QuantizeAppendHost(p, options_.num_threads);
  return absl::OkStatus();
}

absl::Status CpuBackend::CheckEntries(int32_t layer, std::span<const int64_t> entries) const {
  if (layer < 0 || layer >= options_.geometry.num_layers) {
    return absl::InternalError(absl::StrCat("cpu backend: layer ", layer, " out of range"));
  }
  const int64_t total = Entries(options_.geometry);
  for (int64_t e : entries) {
    if (e < 0 || e >= total) {
      return absl::InternalError(absl::StrCat("cpu backend: cache entry ", e, " outside [0, ", total, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::ReadEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& out) {
  MLAKV_RETURN_IF_ERROR(CheckEntries(layer, entries));
  const LayerCaches& c = layers_[layer];
  ForEachRun(entries, [&](size_t i, size_t n) {
    const int64_t e = entries[i];
    std::memcpy(out.ckv_packed + i * kCkvPackedBytes, c.ckv + e * kCkvPackedBytes, n * kCkvPackedBytes);
    std::memcpy(out.ckv_sf + i * kCkvSfBytes, c.sf + e * kCkvSfBytes, n * kCkvSfBytes);
    std::memcpy(out.kpe + i * kKpeBytes, c.kpe + e * kKpeBytes, n * kKpeBytes);
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::WriteEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& in) {
  MLAKV_RETURN_IF_ERROR(CheckEntries(layer, entries));
  const LayerCaches& c = layers_[layer];
  ForEachRun(entries, [&](size_t i, size_t n) {
    const int64_t e = entries[i];
    std::memcpy(c.ckv + e * kCkvPackedBytes, in.ckv_packed + i * kCkvPackedBytes, n * kCkvPackedBytes);
    std::memcpy(c.sf + e * kCkvSfBytes, in.ckv_sf + i * kCkvSfBytes, n * kCkvSfBytes);
    std::memcpy(c.kpe + e * kKpeBytes, in.kpe + i * kKpeBytes, n * kKpeBytes);
  });
  return absl::OkStatus();
}

}  // namespace mlakv::server
