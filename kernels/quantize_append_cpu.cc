// The CPU path of quantize-append: the same params and the same arithmetic
// (nvfp4_format.h) as the CUDA kernel; only the loop around it differs.
//
// Each row is widened to float32 once into a stack buffer, then quantized a
// 16-channel block at a time. The block function is branch-free, which lets
// the compiler vectorize it with baseline SSE2 (no AVX needed, so this runs on
// any x86-64); IEEE semantics are kept because the build forbids fast-math
// and FP contraction.
#include <algorithm>
#include <thread>
#include <vector>

#include "kernels/quantize_append.h"

namespace mlakv {
namespace {

using format::kBlock;
using format::kCkvBlocks;
using format::kCkvDim;
using format::kKpeDim;

template <DType kDType>
inline void Widen(const uint16_t* __restrict src, float* __restrict dst, int n) {
  for (int c = 0; c < n; ++c) {
    dst[c] = kDType == DType::kBFloat16 ? format::Bf16BitsToFloat(src[c]) : format::HalfBitsToFloat(src[c]);
  }
}

template <DType kDType>
void QuantizeRows(const QuantizeAppendParams& p, int64_t row_begin, int64_t row_end) {
  const format::ScaleConstants k = format::MakeScaleConstants(p.ckv_scale, p.kpe_scale);
  const auto* ckv = static_cast<const uint16_t*>(p.append_ckv);
  const auto* kpe = static_cast<const uint16_t*>(p.append_kpe);
  alignas(64) float x[kCkvDim + kKpeDim];
  for (int64_t i = row_begin; i < row_end; ++i) {
    const int64_t entry = CacheEntryOfRow(p, p.batch_indices[i], p.positions[i]);
    if (entry < 0) continue;  // the host entry validated already; never write out of bounds anyway
    Widen<kDType>(ckv + i * p.ckv_row_stride, x, kCkvDim);
    Widen<kDType>(kpe + i * p.kpe_row_stride, x + kCkvDim, kKpeDim);
    uint8_t* packed = p.ckv_cache + CkvOffset(entry);
    uint8_t* sf = p.ckv_sf_cache + CkvSfOffset(entry);
    for (int j = 0; j < kCkvBlocks; ++j) {
      const float(&block)[kBlock] = *reinterpret_cast<const float(*)[kBlock]>(x + j * kBlock);
      uint8_t(&out)[kBlock / 2] = *reinterpret_cast<uint8_t(*)[kBlock / 2]>(packed + j * (kBlock / 2));
      sf[j] = format::QuantizeCkvBlock(block, k, out);
    }
    uint8_t* rope = p.kpe_cache + KpeOffset(entry);
    for (int c = 0; c < kKpeDim; ++c) rope[c] = format::QuantizeKpe(x[kCkvDim + c], k);
  }
}

}  // namespace

void QuantizeAppendHost(const QuantizeAppendParams& p, int num_threads) {
  auto run = [&p](int64_t begin, int64_t end) {
    if (p.dtype == DType::kBFloat16) {
      QuantizeRows<DType::kBFloat16>(p, begin, end);
    } else {
      QuantizeRows<DType::kFloat16>(p, begin, end);
    }
  };
  // Below a few thousand rows a thread costs more than it saves.
  constexpr int64_t kMinRowsPerThread = 2048;
  const int64_t threads = std::clamp<int64_t>(p.num_rows / kMinRowsPerThread, 1, std::max(1, num_threads));
  if (threads == 1) {
    run(0, p.num_rows);
    return;
  }
  std::vector<std::thread> workers;
  const int64_t per = (p.num_rows + threads - 1) / threads;
  for (int64_t t = 1; t < threads; ++t) {
    workers.emplace_back(run, t * per, std::min(p.num_rows, (t + 1) * per));
  }
  run(0, std::min(p.num_rows, per));
  for (std::thread& w : workers) w.join();
}

absl::Status QuantizeAppendCpu(const TensorView& append_ckv, const TensorView& append_kpe,
                               const TensorView& batch_indices, const TensorView& positions,
                               const TensorView& ckv_cache, const TensorView& ckv_sf_cache,
                               const TensorView& kpe_cache, const TensorView& kv_indices,
                               const TensorView& kv_indptr, const TensorView& kv_last_page_len, double ckv_scale,
                               double kpe_scale) {
  absl::StatusOr<QuantizeAppendParams> params =
      MakeQuantizeAppendParams(append_ckv, append_kpe, batch_indices, positions, ckv_cache, ckv_sf_cache, kpe_cache,
                               kv_indices, kv_indptr, kv_last_page_len, ckv_scale, kpe_scale);
  if (!params.ok()) return params.status();
  if (absl::Status s = ValidateRowPlacement(*params); !s.ok()) return s;
  QuantizeAppendHost(*params);
  return absl::OkStatus();
}

}  // namespace mlakv
