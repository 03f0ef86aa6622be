#include "server/cpu_backend.h"

#include <array>

#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kernels/nvfp4_format.h"
#include "kernels/quantize_append.h"

namespace mlakv::server {
namespace {

using format::kCkvPackedBytes;
using format::kCkvSfBytes;
using format::kKpeBytes;

int64_t Entries(const CacheBackend::Geometry& g) { return static_cast<int64_t>(g.num_pages) * g.page_size; }

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
  return static_cast<uint64_t>(Entries(options_.geometry)) * (kCkvPackedBytes + kCkvSfBytes + kKpeBytes) *
         options_.geometry.num_layers;
}

absl::Status CpuBackend::Append(std::span<const LayerAppend> layers) {
  const Geometry& g = options_.geometry;
  // Per (layer, segment): params over that segment's rows. Build and validate
  // all of them before writing anything.
  std::vector<QuantizeAppendParams> all;
  // Placement by segment, one segment per params: {indptr 0, rows, request, start}.
  std::vector<std::array<int32_t, 4>> placements;
  for (const LayerAppend& la : layers) {
    if (la.layer < 0 || la.layer >= g.num_layers) {
      return absl::InternalError(absl::StrCat("cpu backend: layer ", la.layer, " outside [0, ", g.num_layers, ")"));
    }
    const LayerCaches& c = layers_[la.layer];
    for (const AppendSegment& seg : la.segments) {
      if (seg.rows <= 0) continue;
      if (seg.device >= 0) {
        return absl::InternalError("cpu backend: rows in device memory (the region registry refuses them; a bug)");
      }
      QuantizeAppendParams p;
      p.append_ckv = seg.ckv;
      p.append_kpe = seg.kpe;
      p.dtype = la.dtype;
      placements.push_back({0, seg.rows, seg.request, seg.start});
      p.num_rows = seg.rows;
      p.ckv_cache = c.ckv;
      p.ckv_sf_cache = c.sf;
      p.kpe_cache = c.kpe;
      p.num_pages = g.num_pages;
      p.page_size = g.page_size;
      p.kv_indices = la.kv_indices.data();
      p.kv_indptr = la.kv_indptr.data();
      p.batch_size = static_cast<int32_t>(la.kv_indptr.size()) - 1;
      p.num_kv_indices = static_cast<int64_t>(la.kv_indices.size());
      p.ckv_scale = la.ckv_scale;
      p.kpe_scale = la.kpe_scale;
      all.push_back(p);
    }
  }
  // The vectors above no longer reallocate: point the params at them now.
  for (size_t i = 0; i < all.size(); ++i) {
    all[i].segment_indptr = &placements[i][0];
    all[i].segment_request = &placements[i][2];
    all[i].segment_start = &placements[i][3];
    all[i].num_segments = 1;
    if (absl::Status s = ValidateRowPlacement(all[i]); !s.ok()) {
      return absl::InternalError(absl::StrCat("cpu backend: row placement rejected (a server bug): ", s.message()));
    }
    if (!CheckDecodeScale(all[i].ckv_scale, "ckv_scale").ok() || !CheckDecodeScale(all[i].kpe_scale, "kpe_scale").ok()) {
      return absl::InternalError("cpu backend: scales not positive normal (a server bug)");
    }
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
  if (absl::Status s = CheckEntries(layer, entries); !s.ok()) return s;
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
  if (absl::Status s = CheckEntries(layer, entries); !s.ok()) return s;
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
