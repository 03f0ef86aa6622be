#include "server/backend/cache_backend.h"

namespace mlakv::server {

QuantizeAppendParams LayerParams(const LayerAppend& la, const CacheBackend::Geometry& g, uint8_t* ckv, uint8_t* sf,
                                 uint8_t* kpe) {
  QuantizeAppendParams p;
  p.dtype = la.dtype;
  p.ckv_cache = ckv;
  p.ckv_sf_cache = sf;
  p.kpe_cache = kpe;
  p.num_pages = g.num_pages;
  p.page_size = g.page_size;
  p.kv_indices = la.kv_indices.data();
  p.kv_indptr = la.kv_indptr.data();
  p.batch_size = static_cast<int32_t>(la.kv_indptr.size()) - 1;
  p.num_kv_indices = static_cast<int64_t>(la.kv_indices.size());
  p.ckv_scale = la.ckv_scale;
  p.kpe_scale = la.kpe_scale;
  return p;
}

std::optional<RowSource> ContiguousDeviceRows(const LayerAppend& la) {
  if (la.rows) return la.rows->on_device() ? la.rows : std::nullopt;  // in segment order by definition
  const AppendSegment* first = nullptr;
  const char* next_ckv = nullptr;
  const char* next_kpe = nullptr;
  for (const AppendSegment& seg : la.segments) {
    if (seg.count <= 0) continue;
    const RowSource& r = seg.rows;
    if (!r.on_device()) return std::nullopt;
    if (first == nullptr) {
      first = &seg;
    } else if (r.ckv != next_ckv || r.kpe != next_kpe || r.device != first->rows.device ||
               r.ckv_stride_bytes != first->rows.ckv_stride_bytes ||
               r.kpe_stride_bytes != first->rows.kpe_stride_bytes || r.wait_events[0] != first->rows.wait_events[0] ||
               r.wait_events[1] != first->rows.wait_events[1]) {
      return std::nullopt;
    }
    const RowSource next = r.From(static_cast<uint64_t>(seg.count), DTypeSize(la.dtype));
    next_ckv = static_cast<const char*>(next.ckv);
    next_kpe = static_cast<const char*>(next.kpe);
  }
  if (first == nullptr) return std::nullopt;
  return first->rows;
}

}  // namespace mlakv::server
