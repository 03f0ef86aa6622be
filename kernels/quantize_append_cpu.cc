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
#include "common/status_macros.h"

namespace mlakv {
namespace {

using format::kBlock;
using format::kCkvBlocks;
using format::kCkvDim;
using format::kKpeDim;

template <DType kDType>
__attribute__((always_inline)) inline void Widen(const uint16_t* __restrict src, float* __restrict dst, int n) {
  for (int c = 0; c < n; ++c) {
    dst[c] = kDType == DType::kBFloat16 ? format::Bf16BitsToFloat(src[c]) : format::HalfBitsToFloat(src[c]);
  }
}

// One row, docs/format.md ckv steps 1-5, as flat passes over small aligned arrays that the
// compiler vectorizes: widen; block amax as NaN-free magnitudes reduced by a
// tree of halvings inside each block; the 32 block scales; each element's
// multiplier spread out; codes; nibble packing; kpe.
template <DType kDType>
__attribute__((always_inline)) inline void QuantizeRow(const uint16_t* __restrict ckv_row,
                                                       const uint16_t* __restrict kpe_row,
                                                       const format::ScaleConstants& k, uint8_t* __restrict packed,
                                                       uint8_t* __restrict sf, uint8_t* __restrict rope) {
  alignas(64) float x[kCkvBlocks][kBlock];
  alignas(64) float rope_x[kKpeDim];
  alignas(64) float mag[kCkvBlocks][kBlock];
  alignas(64) float half[kCkvBlocks][kBlock / 2];
  alignas(64) float quarter[kCkvBlocks][kBlock / 4];
  alignas(64) float amax[kCkvBlocks];
  alignas(64) float out_scale[kCkvBlocks];
  alignas(64) float scale_of[kCkvBlocks][kBlock];
  alignas(64) uint32_t codes[kCkvBlocks][kBlock];
  Widen<kDType>(ckv_row, &x[0][0], kCkvDim);
  Widen<kDType>(kpe_row, rope_x, kKpeDim);
  // Step 1. NaN magnitudes become 0 first, so the reduction never meets NaN.
  for (int j = 0; j < kCkvBlocks; ++j) {
    for (int c = 0; c < kBlock; ++c) mag[j][c] = format::AbsMaxAccumulate(0.0f, x[j][c]);
  }
  for (int j = 0; j < kCkvBlocks; ++j) {
    for (int c = 0; c < kBlock / 2; ++c) half[j][c] = format::MaxDroppingNan(mag[j][c], mag[j][c + kBlock / 2]);
  }
  for (int j = 0; j < kCkvBlocks; ++j) {
    for (int c = 0; c < kBlock / 4; ++c) quarter[j][c] = format::MaxDroppingNan(half[j][c], half[j][c + kBlock / 4]);
  }
  for (int j = 0; j < kCkvBlocks; ++j) {
    amax[j] = format::MaxDroppingNan(format::MaxDroppingNan(quarter[j][0], quarter[j][1]),
                                     format::MaxDroppingNan(quarter[j][2], quarter[j][3]));
  }
  // Steps 2-4.
  for (int j = 0; j < kCkvBlocks; ++j) sf[j] = format::CkvBlockScale(amax[j], k, &out_scale[j]);
  // Step 5.
  for (int j = 0; j < kCkvBlocks; ++j) {
    for (int c = 0; c < kBlock; ++c) scale_of[j][c] = out_scale[j];
  }
  const float* xs = &x[0][0];
  const float* ss = &scale_of[0][0];
  uint32_t* flat = &codes[0][0];
  for (int i = 0; i < kCkvDim; ++i) flat[i] = format::FloatToE2M1(format::MulRn(xs[i], ss[i]));
  for (int b = 0; b < kCkvDim / 2; ++b) packed[b] = static_cast<uint8_t>(flat[2 * b] | (flat[2 * b + 1] << 4));
  for (int c = 0; c < kKpeDim; ++c) rope[c] = format::QuantizeKpe(rope_x[c], k);
}

// Built for AVX2 and for baseline x86-64; the loader picks the clone the CPU
// supports, so this runs on any x86-64 and uses 8-wide vectors where it can.
// (avx2 implies no FMA, and the build forbids contraction anyway.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MLAKV_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MLAKV_CPU_CLONES
#endif

template <DType kDType>
MLAKV_CPU_CLONES void QuantizeRows(const QuantizeAppendParams& p, int64_t row_begin, int64_t row_end) {
  const format::ScaleConstants k = format::MakeScaleConstants(p.ckv_scale, p.kpe_scale);
  const auto* ckv = static_cast<const uint16_t*>(p.append_ckv);
  const auto* kpe = static_cast<const uint16_t*>(p.append_kpe);
  for (int64_t i = row_begin; i < row_end; ++i) {
    const int64_t entry = CacheEntryOfRowIndex(p, i);
    if (entry < 0) continue;  // the host entry validated already; never write out of bounds anyway
    QuantizeRow<kDType>(ckv + i * p.ckv_row_stride, kpe + i * p.kpe_row_stride, k, p.ckv_cache + CkvOffset(entry),
                        p.ckv_sf_cache + CkvSfOffset(entry), p.kpe_cache + KpeOffset(entry));
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
  MLAKV_RETURN_IF_ERROR(ValidateRowPlacement(*params));
  QuantizeAppendHost(*params);
  return absl::OkStatus();
}

}  // namespace mlakv
