// Random paged-append cases shared by the CPU and CUDA kernel tests: a batch
// of requests with existing prefixes and mixed new lengths, shuffled page
// ids, rows in shuffled order, an input row stride wider than the row, and
// caches poisoned with a byte pattern so that unaddressed bytes can be checked.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/quantize_append.h"
#include "kernels/tensor_view.h"

namespace mlakv::testing {

struct ScenarioOptions {
  DType dtype = DType::kBFloat16;
  int page_size = 16;
  int batch = 5;
  int max_new_tokens = 70;     // per request, drawn in [1, max]
  int max_prefix_tokens = 90;  // tokens already in the request before this append
  int spare_pages = 7;         // pages no request owns (must stay poisoned)
  int extra_row_stride = 24;   // row stride = dim + this (elements); 0 = dense
  bool shuffle_rows = true;
  bool random_bit_rows = true;  // some rows are raw random bits: NaN, inf, subnormals, huge
  uint32_t seed = 1;
};

inline constexpr uint8_t kPoison = 0xA5;

struct PagedScenario {
  ScenarioOptions options;
  int64_t num_rows = 0;
  int num_pages = 0;
  int64_t ckv_row_stride = 0, kpe_row_stride = 0;
  std::vector<uint16_t> ckv, kpe;  // [num_rows, *_row_stride] raw fp16/bf16 bits
  std::vector<int32_t> batch_indices, positions;
  std::vector<int32_t> kv_indices, kv_indptr, kv_last_page_len;
  float ckv_scale = 1, kpe_scale = 1;
  std::vector<uint8_t> ckv_cache, ckv_sf_cache, kpe_cache;  // poisoned

  // Views over this scenario's host vectors.
  TensorView ckv_view() { return TensorView::Rows(ckv.data(), options.dtype, num_rows, 512, ckv_row_stride); }
  TensorView kpe_view() { return TensorView::Rows(kpe.data(), options.dtype, num_rows, 64, kpe_row_stride); }
  TensorView i32(std::vector<int32_t>& v) {
    return TensorView::Contiguous(v.data(), DType::kInt32, {static_cast<int64_t>(v.size())});
  }
  TensorView ckv_cache_view() { return TensorView::Contiguous(ckv_cache.data(), DType::kUInt8, {num_pages, options.page_size, 256}); }
  TensorView sf_cache_view() { return TensorView::Contiguous(ckv_sf_cache.data(), DType::kFloat8E4M3, {num_pages, options.page_size, 32}); }
  TensorView kpe_cache_view() { return TensorView::Contiguous(kpe_cache.data(), DType::kFloat8E4M3, {num_pages, options.page_size, 64}); }

  // Runs the CPU entry on this scenario's host buffers.
  absl::Status RunCpu();
  // Params over the host buffers (what the CUDA test mirrors on the device).
  QuantizeAppendParams HostParams();
  // The rows' placement by segment (QuantizeAppendParams' second form): runs
  // of rows of one request at consecutive positions, each run cut at random
  // points when `split_rng` is given (several segments per request).
  std::vector<int32_t> segment_indptr, segment_request, segment_start;
  void BuildSegments(std::mt19937* split_rng = nullptr);
  // HostParams with batch_indices/positions replaced by the segments.
  QuantizeAppendParams SegmentHostParams();
  // Cache entries addressed by the rows (sorted, unique).
  std::vector<int64_t> AddressedEntries() const;
};

PagedScenario MakeScenario(const ScenarioOptions& options);

// Random fp16/bf16 bits: mostly gaussian rows at row-wise magnitudes spanning
// many decades (with some exact zeros), plus raw random bit patterns.
void FillRandomRows(std::mt19937& rng, DType dtype, int64_t rows, int64_t cols, int64_t stride, bool random_bits,
                    std::vector<uint16_t>& out);

}  // namespace mlakv::testing
