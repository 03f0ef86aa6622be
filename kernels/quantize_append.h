// NVFP4 MLA quantize-append into a paged cache (docs/format.md), CPU and CUDA.
//
// Two levels, as FlashInfer's page.cuh has them:
//  * QuantizeAppendParams: one plain struct of raw pointers and sizes, passed
//    by value to the CUDA kernel and used as-is by the CPU loop, so both paths
//    address memory through the same helpers below.
//  * QuantizeAppendCpu / QuantizeAppendCuda: the public entries over
//    TensorViews that mirror flashinfer.page.nvfp4_quantize_append_paged_mla_kv_cache.
//    They validate everything docs/format.md asks for before a byte is written.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/nvfp4_format.h"
#include "kernels/tensor_view.h"

#if defined(__CUDACC__)
#define MLAKV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MLAKV_HOST_DEVICE inline
#endif

typedef struct CUstream_st* cudaStream_t;

namespace mlakv {

struct QuantizeAppendParams {
  // Rows to append; the last dimension is contiguous, rows are *_row_stride
  // elements apart (>= 512 / >= 64).
  const void* append_ckv = nullptr;  // [num_rows, 512] fp16 or bf16
  const void* append_kpe = nullptr;  // [num_rows, 64], same dtype
  int64_t ckv_row_stride = format::kCkvDim;
  int64_t kpe_row_stride = format::kKpeDim;
  DType dtype = DType::kBFloat16;    // kFloat16 or kBFloat16
  // Where each row goes, one of two forms:
  //  * per row (the seed's signature): batch_indices and positions.
  //  * by segment (batch_indices and positions null): segment s covers rows
  //    [segment_indptr[s], segment_indptr[s+1]) of request segment_request[s]
  //    at consecutive positions from segment_start[s]. A server appending a
  //    run of tokens per sequence describes 262k rows with three tiny arrays
  //    instead of two 1 MB ones, and validates them in O(segments + pages).
  const int32_t* batch_indices = nullptr;  // [num_rows] request of each row
  const int32_t* positions = nullptr;      // [num_rows] token position inside its request
  int64_t num_rows = 0;
  const int32_t* segment_indptr = nullptr;   // [num_segments + 1], non-decreasing, 0 .. num_rows
  const int32_t* segment_request = nullptr;  // [num_segments] batch index of each segment
  const int32_t* segment_start = nullptr;    // [num_segments] position of each segment's first row
  int32_t num_segments = 0;

  // One layer's caches, contiguous.
  uint8_t* ckv_cache = nullptr;     // [num_pages, page_size, 256] packed E2M1, low nibble = even channel
  uint8_t* ckv_sf_cache = nullptr;  // [num_pages, page_size, 32] E4M3 block scales, linear layout
  uint8_t* kpe_cache = nullptr;     // [num_pages, page_size, 64] E4M3
  int32_t num_pages = 0;
  int32_t page_size = 0;

  // The page table: request b owns kv_indices[kv_indptr[b] .. kv_indptr[b+1]).
  const int32_t* kv_indices = nullptr;  // [kv_indptr[batch_size]]
  const int32_t* kv_indptr = nullptr;   // [batch_size + 1]
  int32_t batch_size = 0;
  int64_t num_kv_indices = 0;           // length of kv_indices

  float ckv_scale = 1.0f;  // global decode scales, positive normal float32
  float kpe_scale = 1.0f;

  // CUDA only, optional: a device counter incremented once per row that the
  // kernel's bounds guard skipped (it never writes such a row).
  unsigned int* skipped_rows = nullptr;
  // CUDA only, optional: a word set to 1 (a plain store, never cleared here)
  // when the bounds guard skipped any row. Given a host-mapped word
  // (cudaHostAllocMapped), the host sees after the stream's synchronize
  // whether a launch skipped anything without a device-to-host copy on
  // every call; the count is then read from `skipped_rows`.
  unsigned int* skipped_flag = nullptr;
};

// The cache entry a row lands in, or -1 when the row is out of bounds (docs/format.md
// "Bounds"): bad batch index, negative position, page_iter outside the
// request's pages (or outside kv_indices), or page id outside [0, num_pages).
MLAKV_HOST_DEVICE int64_t CacheEntryOfRow(const QuantizeAppendParams& p, int32_t b, int32_t pos) {
  if (b < 0 || b >= p.batch_size || pos < 0) return -1;
  const int64_t begin = p.kv_indptr[b];
  const int64_t end = p.kv_indptr[b + 1] < p.num_kv_indices ? p.kv_indptr[b + 1] : p.num_kv_indices;
  const int64_t page_iter = begin + pos / p.page_size;
  if (begin < 0 || page_iter >= end) return -1;
  const int32_t page = p.kv_indices[page_iter];
  if (page < 0 || page >= p.num_pages) return -1;
  return static_cast<int64_t>(page) * p.page_size + pos % p.page_size;
}

MLAKV_HOST_DEVICE int32_t LoadIndex(const int32_t* ptr) {
#if defined(__CUDA_ARCH__)
  return __ldg(ptr);  // read-only path: index arrays are never written by the kernel
#else
  return *ptr;
#endif
}

// The cache entry of row `row` in either placement form, or -1 when out of
// bounds. By segment, the row's segment is found by a first probe where
// equal segments would put it, then binary search over segment_indptr (one
// step for a single run; the kernel does it once per 8 rows). Never reads outside the index arrays, whatever their contents.
MLAKV_HOST_DEVICE int64_t CacheEntryOfRowIndex(const QuantizeAppendParams& p, int64_t row) {
  if (p.segment_indptr == nullptr) {
    return CacheEntryOfRow(p, LoadIndex(p.batch_indices + row), LoadIndex(p.positions + row));
  }
  int32_t lo = 0, hi = p.num_segments;  // segment_indptr[lo] <= row < segment_indptr[hi]
  const int32_t first = hi > 0 ? LoadIndex(p.segment_indptr) : 0, end = hi > 0 ? LoadIndex(p.segment_indptr + hi) : 0;
  if (hi <= 0 || row < first || row >= end) return -1;
  // First probe where equal segments would put the row: a decode step (one
  // row per segment) finds its segment there in two loads instead of
  // log2(segments) dependent ones; any other split narrows from there.
  if (hi > 1) {
    const int32_t guess = static_cast<int32_t>((row - first) * hi / (end - first));
    if (LoadIndex(p.segment_indptr + guess) <= row) {
      lo = guess;
      if (guess + 1 < hi && row < LoadIndex(p.segment_indptr + guess + 1)) hi = guess + 1;
    } else {
      hi = guess;
    }
  }
  while (hi - lo > 1) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (LoadIndex(p.segment_indptr + mid) <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const int64_t pos = LoadIndex(p.segment_start + lo) + (row - LoadIndex(p.segment_indptr + lo));
  if (pos > 0x7FFFFFFF) return -1;
  return CacheEntryOfRow(p, LoadIndex(p.segment_request + lo), static_cast<int32_t>(pos));
}

// True when `p` carries one of the two placement forms completely.
inline bool HasPlacement(const QuantizeAppendParams& p) {
  return p.segment_indptr != nullptr
             ? p.segment_request != nullptr && p.segment_start != nullptr && p.num_segments >= 1
             : p.batch_indices != nullptr && p.positions != nullptr;
}

// Byte offsets of an entry inside the three caches.
MLAKV_HOST_DEVICE int64_t CkvOffset(int64_t entry) { return entry * format::kCkvPackedBytes; }
MLAKV_HOST_DEVICE int64_t CkvSfOffset(int64_t entry) { return entry * format::kCkvSfBytes; }
MLAKV_HOST_DEVICE int64_t KpeOffset(int64_t entry) { return entry * format::kKpeBytes; }

// The scales as float32, or INVALID_ARGUMENT unless both are finite, positive
// and normal after rounding to float32 (docs/format.md "Scales"). `what` names them in
// the message ("ckv_scale").
absl::StatusOr<float> CheckDecodeScale(double scale, const char* what);

// Builds params from views, checking dims, dtypes, shapes, strides and scales.
// Does not read index memory (it may live on the device).
absl::StatusOr<QuantizeAppendParams> MakeQuantizeAppendParams(
    const TensorView& append_ckv, const TensorView& append_kpe, const TensorView& batch_indices,
    const TensorView& positions, const TensorView& ckv_cache, const TensorView& ckv_sf_cache,
    const TensorView& kpe_cache, const TensorView& kv_indices, const TensorView& kv_indptr,
    const TensorView& kv_last_page_len, double ckv_scale, double kpe_scale);

// Checks every row's placement against host-resident index arrays: indptr
// monotone and inside kv_indices, every row in bounds (by segment: the
// segments tile [0, num_rows) in order and each one's pages exist).
// OUT_OF_RANGE names the first offending row or segment. The CPU entry calls it; callers of the CUDA entry that
// hold host copies of the indices (the server does) call it before launching.
absl::Status ValidateRowPlacement(const QuantizeAppendParams& host_params);

// The CPU implementation (host memory everywhere). Validates, then writes.
absl::Status QuantizeAppendCpu(const TensorView& append_ckv, const TensorView& append_kpe,
                               const TensorView& batch_indices, const TensorView& positions,
                               const TensorView& ckv_cache, const TensorView& ckv_sf_cache,
                               const TensorView& kpe_cache, const TensorView& kv_indices,
                               const TensorView& kv_indptr, const TensorView& kv_last_page_len, double ckv_scale,
                               double kpe_scale);

// The CUDA implementation (device memory everywhere), enqueued on `stream`.
// Index arrays are not read on the host: rows out of bounds are skipped by the
// kernel and counted in `skipped_rows` (a device counter) when given.
absl::Status QuantizeAppendCuda(const TensorView& append_ckv, const TensorView& append_kpe,
                                const TensorView& batch_indices, const TensorView& positions,
                                const TensorView& ckv_cache, const TensorView& ckv_sf_cache,
                                const TensorView& kpe_cache, const TensorView& kv_indices,
                                const TensorView& kv_indptr, const TensorView& kv_last_page_len, double ckv_scale,
                                double kpe_scale, cudaStream_t stream, unsigned int* skipped_rows = nullptr);

// Lower-level entries on validated params (the server builds params itself).
// The CPU one uses `num_threads` host threads (<= 1: the calling thread only).
void QuantizeAppendHost(const QuantizeAppendParams& params, int num_threads = 1);
// The launcher: picks the configuration, launches on `stream`, checks the launch.
absl::Status QuantizeAppend(const QuantizeAppendParams& params, cudaStream_t stream);

// Several layers' appends in one launch (a decode step writes one token of
// every sequence into each of 61 layers: 61 launches cost ~150 us of launch
// overhead against one). Grid row y runs layers[y]; the params travel by
// value in the kernel's parameter space (up to 32 KB from CUDA 12.1), so a
// block reads its layer's fields from the constant bank as the one-layer
// kernel does. More layers than this are split into several launches.
inline constexpr int kMaxLayersPerLaunch = 64;
struct QuantizeAppendLayersParams {
  QuantizeAppendParams layers[kMaxLayersPerLaunch];
  int32_t num_layers = 0;
};
// Launches `count` layers' params (each as QuantizeAppend takes them; the
// configuration is picked from the largest layer's row count).
absl::Status QuantizeAppendLayers(const QuantizeAppendParams* layers, int count, cudaStream_t stream);

}  // namespace mlakv
