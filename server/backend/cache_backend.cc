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

}  // namespace mlakv::server
