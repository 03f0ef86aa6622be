// The CUDA quantize-append kernel and its launcher.
//
// Thread-to-data mapping (one warp per row, the whole row in one pass):
//   step 1  lane j loads ckv channels 16j..16j+15 (block j) as two 16-byte
//           loads, and kpe channels 2j, 2j+1 as one 4-byte load; lanes 0..31
//           together read the row's 1024 + 128 bytes, coalesced.
//   step 2  lane j computes block j's amax, scale byte and 8 packed bytes with
//           nothing shared between lanes (a block never spans two lanes); the
//           element multiplier of each scale byte comes from a 128-entry
//           table the block fills once in shared memory, and at 8 or more
//           rows per warp the E2M1 codes from a 2048-entry one (nvfp4_format.h,
//           E2M1TableIndex), filled from the same arithmetic.
//   step 3  lane j stores 8 packed bytes at ckv_cache[entry, 8j..8j+7], its
//           scale byte at ckv_sf_cache[entry, j] and 2 kpe bytes at
//           kpe_cache[entry, 2j..2j+1]: per warp, 256 + 32 + 64 contiguous bytes.
// A warp handles kRowsPerWarp rows per iteration of a loop over its share of
// the rows (every W-th group of the launch, or every w-th group of its
// block's contiguous range: QuantizeAppendConfig::block_ranges):
// lane r follows row r's placement (batch -> kv_indptr -> kv_indices, three
// dependent loads) so one lookup pass serves all the rows, and the entries are
// broadcast with shuffles. Rows go two at a time, both loaded before use; the
// first pair's loads are issued before the lookup so that the two overlap.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "kernels/cuda_check.h"
#include "kernels/quantize_append.h"
#include "kernels/quantize_append_config.h"

namespace mlakv {
namespace {

using format::kBlock;
using format::kCkvBlocks;
using format::kCkvDim;
using format::kKpeDim;

constexpr int kWarpSize = 32;
constexpr int kMaxWarpsPerBlock = 32;
static_assert(kCkvBlocks == kWarpSize, "one lane per 16-channel ckv block: 512 / 16 must be 32");
static_assert(kKpeDim == 2 * kWarpSize, "each lane owns two kpe channels: kpe_dim must be 64");

// Raw fp16/bf16 bits of one lane's share of a row, two elements per word
// (element 2k in the low half of word k, as little-endian memory has it).
struct LaneRow {
  uint32_t ckv[kBlock / 2];
  uint32_t kpe;
};

template <bool kVectorized>
__device__ __forceinline__ void LoadLaneRow(const QuantizeAppendParams& p, int64_t row, int lane, LaneRow& r) {
  const uint16_t* ckv = static_cast<const uint16_t*>(p.append_ckv) + row * p.ckv_row_stride + lane * kBlock;
  const uint16_t* kpe = static_cast<const uint16_t*>(p.append_kpe) + row * p.kpe_row_stride + lane * 2;
  if constexpr (kVectorized) {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(ckv));
    const uint4 b = __ldg(reinterpret_cast<const uint4*>(ckv) + 1);
    r.ckv[0] = a.x, r.ckv[1] = a.y, r.ckv[2] = a.z, r.ckv[3] = a.w;
    r.ckv[4] = b.x, r.ckv[5] = b.y, r.ckv[6] = b.z, r.ckv[7] = b.w;
    r.kpe = __ldg(reinterpret_cast<const unsigned int*>(kpe));
  } else {
    const auto* c = reinterpret_cast<const unsigned short*>(ckv);
#pragma unroll
    for (int w = 0; w < kBlock / 2; ++w) r.ckv[w] = __ldg(c + 2 * w) | (static_cast<uint32_t>(__ldg(c + 2 * w + 1)) << 16);
    const auto* k = reinterpret_cast<const unsigned short*>(kpe);
    r.kpe = __ldg(k) | (static_cast<uint32_t>(__ldg(k + 1)) << 16);
  }
}

// Exact widening of a word's two elements (same values as format::*BitsToFloat).
template <DType kDType>
__device__ __forceinline__ float2 WidenPair(uint32_t w) {
  if constexpr (kDType == DType::kBFloat16) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
  } else {
    __half2 h;
    memcpy(&h, &w, sizeof(h));
    return __half22float2(h);
  }
}

// kScaleTable: the block-scale multiplier from `out_scale_of` (else computed).
// kCodeTable: E2M1 codes from the shared-memory table `code_of` (5
// instructions a channel with the lookup, against 8 for the arithmetic form;
// the kernel is issue-bound at large sizes, docs/performance.md).
template <DType kDType, bool kScaleTable, bool kCodeTable>
__device__ __forceinline__ void QuantizeAndStore(const QuantizeAppendParams& p, const format::ScaleConstants& k,
                                                 const float* out_scale_of, const uint8_t* code_of, int64_t entry,
                                                 int lane, const LaneRow& r) {
  float x[kBlock];
#pragma unroll
  for (int w = 0; w < kBlock / 2; ++w) {
    const float2 f = WidenPair<kDType>(r.ckv[w]);
    x[2 * w] = f.x;
    x[2 * w + 1] = f.y;
  }
  float amax = 0.0f;
#pragma unroll
  for (int c = 0; c < kBlock; ++c) amax = format::AbsMaxAccumulate(amax, x[c]);
  const uint8_t sf = format::CkvScaleByte(amax, k);
  // sf is never negative (amax, inv6g >= 0): 128 table entries cover it.
  const float out_scale = kScaleTable ? out_scale_of[sf & 0x7F] : format::CkvOutScale(sf, k);
  // Channel c's code goes to bits 4(c % 8).. of word c / 8: byte k holds
  // channels 2k (low nibble) and 2k+1 (high nibble), docs/format.md ckv step 5.
  uint2 packed = make_uint2(0, 0);
  uint32_t bits[kBlock];
#pragma unroll
  for (int c = 0; c < kBlock; ++c) {
    const float v = format::MulRn(x[c], out_scale);
    bits[c] = __float_as_uint(v);
    uint32_t code;
    if constexpr (kCodeTable) {
      code = code_of[format::E2M1TableIndex(bits[c])];
    } else {
      code = format::FloatToE2M1Magnitude(v);
    }
    if (c < 8) {
      packed.x += code << (4 * c);
    } else {
      packed.y += code << (4 * (c - 8));
    }
  }
  // The sign of channel c (bit 31 of its product; a NaN product is canonical,
  // sign clear, as docs/format.md wants) goes to bit 3 of its nibble. Byte 3 of each
  // product holds the sign at bit 7: the even channels' byte 3s gathered into
  // one word put their signs at bits 7, 15, 23, 31, and shifted right by 4 at
  // bits 3, 11, 19, 27 -- their low nibbles' tops; the odd channels' land on
  // bits 7, 15, 23, 31 -- their high nibbles' tops -- unshifted. Six byte
  // permutes per 8 channels instead of a shift and a merge per channel.
  auto gather_top_bytes = [](uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    return __byte_perm(__byte_perm(a, b, 0x0073), __byte_perm(c, d, 0x0073), 0x5410);
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t* q = bits + 8 * h;
    const uint32_t even = gather_top_bytes(q[0], q[2], q[4], q[6]);
    const uint32_t odd = gather_top_bytes(q[1], q[3], q[5], q[7]);
    const uint32_t signs = ((even >> 4) & 0x08080808u) | (odd & 0x80808080u);
    if (h == 0) {
      packed.x |= signs;
    } else {
      packed.y |= signs;
    }
  }
  const float2 rope = WidenPair<kDType>(r.kpe);
  // Cache rows are 256 / 32 / 64 bytes, so these stores are 8-, 1- and 2-byte aligned.
  reinterpret_cast<uint2*>(p.ckv_cache + CkvOffset(entry))[lane] = packed;
  p.ckv_sf_cache[CkvSfOffset(entry) + lane] = sf;
  reinterpret_cast<uint16_t*>(p.kpe_cache + KpeOffset(entry))[lane] = format::QuantizeKpePair(rope.x, rope.y, k);
}

// Blocks of up to 1024 threads, at least one resident per SM: the 64K
// registers of an SM over 1024 threads cap registers at 64, which this kernel
// fits without spilling; any 1024 threads (four blocks of 256, one of 1024)
// are then resident at once. (A cap of 48, for 1280 threads, spilled and ran
// 25% slower on the H200; see docs/performance.md.)
constexpr int kMinBlocksPerSm = 1;

// One layer's rows, this block's share of them (blockIdx.x of gridDim.x):
// the body of both kernels below.
template <DType kDType, bool kVectorized, int kRowsPerWarp>
__device__ __forceinline__ void QuantizeAppendRows(const QuantizeAppendParams& p, bool block_ranges) {
  static_assert(kRowsPerWarp >= 1 && kRowsPerWarp <= kWarpSize, "lane r looks up row r's entry");
  const int lane = threadIdx.x % kWarpSize;
  const int warp_in_block = threadIdx.x / kWarpSize;
  const int warps_per_block = blockDim.x / kWarpSize;
  // The warp takes row groups first_row, first_row + stride, ... below
  // end_row (QuantizeAppendConfig::block_ranges says which form and why).
  int64_t first_row, stride, end_row;
  if (block_ranges) {
    const int64_t share = p.num_rows / gridDim.x, extra = p.num_rows % gridDim.x;
    const int64_t block_begin = blockIdx.x * share + min(static_cast<int64_t>(blockIdx.x), extra);
    end_row = block_begin + share + (blockIdx.x < extra ? 1 : 0);
    first_row = block_begin + static_cast<int64_t>(warp_in_block) * kRowsPerWarp;
    stride = static_cast<int64_t>(warps_per_block) * kRowsPerWarp;
  } else {
    first_row = (static_cast<int64_t>(blockIdx.x) * warps_per_block + warp_in_block) * kRowsPerWarp;
    stride = static_cast<int64_t>(gridDim.x) * warps_per_block * kRowsPerWarp;
    end_row = p.num_rows;
  }
  const format::ScaleConstants k = format::MakeScaleConstants(p.ckv_scale, p.kpe_scale);
  // The warp's first row is requested before the block fills its tables, so
  // its loads are in flight during the fill (one row: two would spill; the
  // scalar path spills even with one, so it loads after the fill).
  LaneRow pair[2];
  constexpr bool kPreload = kVectorized;
  if (kPreload && first_row < end_row) LoadLaneRow<kVectorized>(p, first_row, lane, pair[0]);
  // docs/format.md ckv step 4 depends on the scale byte alone: with several rows per
  // warp, tabulate it once per block for the 128 non-negative bytes instead
  // of a reciprocal per row. At one row per warp (launches below 16k rows,
  // decode) each lane needs exactly one value, so it computes it and the
  // block skips the fill and the barrier.
  constexpr bool kScaleTable = kRowsPerWarp > 1;
  __shared__ float out_scale_of[kScaleTable ? 128 : 1];
  if constexpr (kScaleTable) {
    for (int b = threadIdx.x; b < 128; b += blockDim.x) {
      out_scale_of[b] = format::CkvOutScale(static_cast<uint8_t>(b), k);
    }
  }
  // Large launches (8 or 16 rows per warp, 124 to a few thousand rows per
  // block) fill the E2M1 code table once per block; smaller ones keep the
  // arithmetic form.
  constexpr bool kCodeTable = kRowsPerWarp >= 8;
  __shared__ uint8_t code_of[kCodeTable ? format::kE2M1TableSize : 1];
  if constexpr (kCodeTable) {
    for (int i = threadIdx.x; i < format::kE2M1TableSize; i += blockDim.x) {
      code_of[i] = static_cast<uint8_t>(format::FloatToE2M1Magnitude(format::E2M1TableRepresentative(i)));
    }
  }
  if constexpr (kScaleTable || kCodeTable) __syncthreads();

  for (int64_t first = first_row; first < end_row; first += stride) {
    const int rows = static_cast<int>(end_row - first < kRowsPerWarp ? end_row - first : kRowsPerWarp);
    // Rows are taken two at a time, both loaded before either is used. The
    // first pair's loads go out before the placement lookup, so they overlap.
    if (!kPreload || first != first_row) LoadLaneRow<kVectorized>(p, first, lane, pair[0]);
    if (rows > 1) LoadLaneRow<kVectorized>(p, first + 1, lane, pair[1]);
    // Placement of all the warp's rows at once: lane r follows row r's chain
    // of dependent loads (batch -> kv_indptr -> kv_indices; by segment, the
    // binary search over segment_indptr first).
    int64_t my_entry = -2;
    if (lane < rows) my_entry = CacheEntryOfRowIndex(p, first + lane);
    const unsigned skipped = __ballot_sync(0xFFFFFFFFu, my_entry == -1);
    if (skipped != 0 && lane == 0) {  // never written (docs/format.md "Bounds are checked")
      if (p.skipped_rows != nullptr) atomicAdd(p.skipped_rows, static_cast<unsigned>(__popc(skipped)));
      if (p.skipped_flag != nullptr) *p.skipped_flag = 1u;
    }
    constexpr int kUnroll = kRowsPerWarp > 8 ? 1 : (kRowsPerWarp + 1) / 2;  // 16 rows unrolled spill
#pragma unroll kUnroll
    for (int r = 0; r < kRowsPerWarp; r += 2) {
      if (r >= rows) break;
      if (r > 0) {
        LoadLaneRow<kVectorized>(p, first + r, lane, pair[0]);
        if (r + 1 < rows) LoadLaneRow<kVectorized>(p, first + r + 1, lane, pair[1]);
      }
      const int64_t e0 = __shfl_sync(0xFFFFFFFFu, my_entry, r);
      const int64_t e1 = __shfl_sync(0xFFFFFFFFu, my_entry, (r + 1) % kWarpSize);
      if (e0 >= 0) {
        QuantizeAndStore<kDType, kScaleTable, kCodeTable>(p, k, out_scale_of, code_of, e0, lane, pair[0]);
      }
      if (r + 1 < rows && e1 >= 0) {
        QuantizeAndStore<kDType, kScaleTable, kCodeTable>(p, k, out_scale_of, code_of, e1, lane, pair[1]);
      }
    }
  }
}

template <DType kDType, bool kVectorized, int kRowsPerWarp>
__global__ void __launch_bounds__(kWarpSize * kMaxWarpsPerBlock, kMinBlocksPerSm)
    QuantizeAppendKernel(const QuantizeAppendParams p, bool block_ranges) {
  QuantizeAppendRows<kDType, kVectorized, kRowsPerWarp>(p, block_ranges);
}

// Grid row blockIdx.y runs layer blockIdx.y; its params are read from the
// parameter space (constant bank) like the one-layer kernel's.
template <DType kDType, bool kVectorized, int kRowsPerWarp>
__global__ void __launch_bounds__(kWarpSize * kMaxWarpsPerBlock, kMinBlocksPerSm)
    QuantizeAppendLayersKernel(const QuantizeAppendLayersParams lp) {
  QuantizeAppendRows<kDType, kVectorized, kRowsPerWarp>(lp.layers[blockIdx.y], /*block_ranges=*/false);
}

// The SM count of the current device, looked up once per device (a
// cudaDeviceGetAttribute per launch costs ~1 us of host time).
cudaError_t CurrentSmCount(int* sms) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= 0 && device < kMaxDevices && cached[device].load(std::memory_order_relaxed) > 0) {
    *sms = cached[device].load(std::memory_order_relaxed);
    return cudaSuccess;
  }
  err = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess && device >= 0 && device < kMaxDevices) cached[device].store(*sms, std::memory_order_relaxed);
  return err;
}

// Blocks for `rows` rows of one layer: enough to fill every SM, and no more
// than the rows need (a grid-stride loop covers the rest). Dealt as block
// ranges, the grid is a whole number of blocks per SM, so that every SM gets
// the same rows (one layer's launch only: a layers launch deals by warp).
int BlocksFor(int64_t rows, int rows_per_warp, const QuantizeAppendConfig& config, int sms, bool one_layer) {
  const int64_t rows_per_block = static_cast<int64_t>(config.warps_per_block) * rows_per_warp;
  int64_t wanted = (rows + rows_per_block - 1) / rows_per_block;
  if (config.block_ranges && one_layer) wanted = (wanted + sms - 1) / sms * sms;
  return static_cast<int>(std::min<int64_t>(wanted, static_cast<int64_t>(sms) * config.blocks_per_sm));
}

// One launch of either kernel: `Params` is QuantizeAppendParams (one layer)
// or QuantizeAppendLayersParams (grid rows = layers).
template <DType kDType, bool kVectorized, int kRowsPerWarp, typename Params>
cudaError_t Launch(const Params& p, int64_t rows, int layers, const QuantizeAppendConfig& config,
                   cudaStream_t stream) {
  constexpr bool kOneLayer = !std::is_same_v<Params, QuantizeAppendLayersParams>;
  int sms = 0;
  if (cudaError_t err = CurrentSmCount(&sms); err != cudaSuccess) return err;
  const dim3 grid(BlocksFor(rows, kRowsPerWarp, config, sms, kOneLayer), layers);
  const int threads = kWarpSize * config.warps_per_block;
  if constexpr (kOneLayer) {
    QuantizeAppendKernel<kDType, kVectorized, kRowsPerWarp><<<grid, threads, 0, stream>>>(p, config.block_ranges);
  } else {
    QuantizeAppendLayersKernel<kDType, kVectorized, kRowsPerWarp><<<grid, threads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <DType kDType, bool kVectorized, typename Params>
cudaError_t LaunchRows(const Params& p, int64_t rows, int layers, const QuantizeAppendConfig& config,
                       cudaStream_t stream) {
  switch (config.rows_per_warp) {
    case 1: return Launch<kDType, kVectorized, 1>(p, rows, layers, config, stream);
    case 2: return Launch<kDType, kVectorized, 2>(p, rows, layers, config, stream);
    case 4: return Launch<kDType, kVectorized, 4>(p, rows, layers, config, stream);
    case 8: return Launch<kDType, kVectorized, 8>(p, rows, layers, config, stream);
    default: return Launch<kDType, kVectorized, 16>(p, rows, layers, config, stream);  // validated: 16
  }
}

// 16-byte loads need 16-byte aligned ckv rows and 4-byte aligned kpe pairs;
// anything else (an odd row stride, a sliced tensor) takes the scalar path.
bool Vectorizable(const QuantizeAppendParams& p) {
  const auto addr = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr); };
  return addr(p.append_ckv) % 16 == 0 && (p.ckv_row_stride * 2) % 16 == 0 && addr(p.append_kpe) % 4 == 0 &&
         (p.kpe_row_stride * 2) % 4 == 0;
}

// `vectorized`: every layer's rows take 16-byte loads.
template <typename Params>
cudaError_t LaunchFor(const Params& p, DType dtype, bool vectorized, int64_t rows, int layers,
                      const QuantizeAppendConfig& config, cudaStream_t stream) {
  if (dtype == DType::kBFloat16) {
    return vectorized ? LaunchRows<DType::kBFloat16, true>(p, rows, layers, config, stream)
                      : LaunchRows<DType::kBFloat16, false>(p, rows, layers, config, stream);
  }
  return vectorized ? LaunchRows<DType::kFloat16, true>(p, rows, layers, config, stream)
                    : LaunchRows<DType::kFloat16, false>(p, rows, layers, config, stream);
}

absl::Status CheckParams(const QuantizeAppendParams& p) {
  if (p.page_size <= 0 || p.batch_size < 0 || p.ckv_cache == nullptr || p.ckv_sf_cache == nullptr ||
      p.kpe_cache == nullptr || p.append_ckv == nullptr || p.append_kpe == nullptr ||
      p.kv_indptr == nullptr || !HasPlacement(p)) {
    return absl::InvalidArgumentError("QuantizeAppend: params are incomplete (null pointer or page_size < 1)");
  }
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) {
    return absl::InvalidArgumentError(absl::StrCat("QuantizeAppend: rows must be float16 or bfloat16, got ",
                                                   DTypeName(p.dtype)));
  }
  return absl::OkStatus();
}

absl::Status CheckConfig(const QuantizeAppendConfig& config) {
  const int rpw = config.rows_per_warp;
  if ((rpw != 1 && rpw != 2 && rpw != 4 && rpw != 8 && rpw != 16) ||
      config.warps_per_block < 1 || config.warps_per_block > kMaxWarpsPerBlock || config.blocks_per_sm < 1) {
    return absl::InvalidArgumentError(absl::StrCat("QuantizeAppend: unsupported config rows_per_warp=",
                                                   config.rows_per_warp, " warps_per_block=", config.warps_per_block,
                                                   " blocks_per_sm=", config.blocks_per_sm));
  }
  return absl::OkStatus();
}

// QuantizeAppendLayers and its explicit-configuration form (`config` null:
// each launch's default, and QuantizeAppend for layers that go alone).
absl::Status LaunchLayers(const QuantizeAppendParams* layers, int count, const QuantizeAppendConfig* config,
                          cudaStream_t stream) {
  if (config != nullptr) {
    if (absl::Status s = CheckConfig(*config); !s.ok()) return s;
  }
  auto alone = [&](const QuantizeAppendParams& p) {
    return config != nullptr ? QuantizeAppendWithConfig(p, *config, stream) : QuantizeAppend(p, stream);
  };
  for (int first = 0; first < count; first += kMaxLayersPerLaunch) {
    const int n = std::min(count - first, kMaxLayersPerLaunch);
    if (n == 1) {
      if (absl::Status s = alone(layers[first]); !s.ok()) return s;
      continue;
    }
    // One dtype and one load path for the launch: the kernel is templated
    // on both. Layers that differ go one launch each.
    const QuantizeAppendParams& head = layers[first];
    bool uniform = true, vectorized = true;
    int64_t rows = 0;
    for (int i = first; i < first + n; ++i) {
      if (absl::Status s = CheckParams(layers[i]); layers[i].num_rows > 0 && !s.ok()) return s;
      uniform = uniform && layers[i].dtype == head.dtype;
      vectorized = vectorized && Vectorizable(layers[i]);
      rows = std::max(rows, layers[i].num_rows);
    }
    if (!uniform) {
      for (int i = first; i < first + n; ++i) {
        if (absl::Status s = alone(layers[i]); !s.ok()) return s;
      }
      continue;
    }
    if (rows == 0) continue;
    QuantizeAppendLayersParams lp;
    for (int i = 0; i < n; ++i) lp.layers[i] = layers[first + i];
    lp.num_layers = n;
    const QuantizeAppendConfig used = config != nullptr ? *config : DefaultQuantizeAppendLayersConfig(rows);
    const cudaError_t err = LaunchFor(lp, head.dtype, vectorized, rows, n, used, stream);
    if (err != cudaSuccess) {
      return CudaStatus(err, absl::StrCat("QuantizeAppendLayersKernel launch (", n, " layers of up to ", rows, " rows)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// Rows per lookup and the grid's shape by row count, shared by the one-layer
// and the layers launch.
QuantizeAppendConfig ConfigByRowCount(int64_t num_rows) {
  QuantizeAppendConfig c;
  // Few rows: one per warp, for the most warps in flight. Many rows: one
  // placement lookup serves 8 or 16 rows (lanes 0..15 run the chains side by
  // side), which leaves each warp fewer dependent-load chains to wait on.
  // From ~64k rows, 16: at 65k rows every warp of one wave then has exactly
  // one group (H200, the four 65k cases, two sweeps of 100 launches: 88.6%
  // of the copy on average against 87.2% with 8 rows per lookup).
  // From 16k to 64k rows (chunked-prefill sizes), 4: twice the warps of 8
  // rows per lookup with a group each, and no code table to fill (H100,
  // 2026-12-05, four sweeps of 100-200 launches: 16,384 rows 87.7-90.7% of
  // the copy against 86.2-88.2% at 8; 32,768 rows 92.7-93.6% against
  // 91.1-92.5%; docs/performance.md "Four rows per lookup at chunked-prefill
  // sizes").
  c.rows_per_warp = num_rows >= 65536 ? 16 : num_rows >= 16384 ? 4 : 1;
  // Below ~128k rows, one wave of resident blocks (4 of 8 warps per SM) that
  // takes the rows as equal contiguous ranges per block. Two waves of blocks
  // that each fill their tables for one group are slower (65k rows, v7: 81.7%
  // vs 79.3% of the copy), and rows dealt by warp leave some blocks (so some
  // SMs) a group per warp short while the launch lasts as long as the busiest
  // SM (65k rows, 8 rows per lookup: +1.2 to +2.0 points of the copy with
  // ranges). Above, 8 blocks per SM dealt by warp (1M rows, 16 per lookup:
  // 93.6% against 92.2% with 4 per SM and 90.8% with 4 per SM as ranges).
  if (num_rows >= 16384 && num_rows < 131072) {
    c.blocks_per_sm = 4;
    c.block_ranges = true;
  }
  return c;
}

}  // namespace

QuantizeAppendConfig DefaultQuantizeAppendConfig(int64_t num_rows) {
  QuantizeAppendConfig c = ConfigByRowCount(num_rows);
  // From 16k to 32k rows, the same 32 warps per SM as 8 blocks of 4 warps
  // instead of 4 blocks of 8: every sweep of 16,384 rows on an H100 put it
  // first or second of the 26 configurations, 0.3-1.6 points of the copy
  // above 4 x 8 (2026-12-05 two hosts, 2026-12-06 23:38 87.7% against
  // 86.5-87.3%, 2026-12-07 08:19 86.9% against 86.0%); at 32,768 rows it
  // was 0.8 points below (docs/performance.md "The aims from a committed
  // script; 16k-row launches as 8 blocks of 4 warps"). Layers launches keep 4 x 8: their
  // rows are dealt by warp, and no sweep measured the smaller blocks there.
  if (num_rows >= 16384 && num_rows < 32768) {
    c.warps_per_block = 4;
    c.blocks_per_sm = 8;
  }
  return c;
}

absl::Status QuantizeAppendWithConfig(const QuantizeAppendParams& p, const QuantizeAppendConfig& config,
                                      cudaStream_t stream) {
  if (p.num_rows == 0) return absl::OkStatus();
  if (absl::Status s = CheckParams(p); !s.ok()) return s;
  if (absl::Status s = CheckConfig(config); !s.ok()) return s;
  const cudaError_t err = LaunchFor(p, p.dtype, Vectorizable(p), p.num_rows, 1, config, stream);
  return CudaStatus(err, absl::StrCat("QuantizeAppendKernel launch (", p.num_rows, " rows)"));
}

absl::Status QuantizeAppend(const QuantizeAppendParams& p, cudaStream_t stream) {
  return QuantizeAppendWithConfig(p, DefaultQuantizeAppendConfig(p.num_rows), stream);
}

QuantizeAppendConfig DefaultQuantizeAppendLayersConfig(int64_t max_rows) {
  // The one-layer configuration of the largest layer, its rows dealt by
  // warp (block ranges assume one layer's rows per grid), except that decode
  // steps (N sequences x 1 token x 61 layers) take more rows per lookup:
  // from 128 rows a layer 8 (256 x 61: 244 blocks of 8 warps instead of
  // 1,952, each warp one group -- 18.4-19.0 us against 22.4-22.6 us at one
  // row per warp, 1.17-1.20x a copy of the step's bytes against 1.40x), and
  // from 32 rows 2 (64 x 61: 14.2 us against 16.4 us; 32 x 61: 13.5 against
  // 14.2). quantize_append_bench --sweep --only decode_step on the H200,
  // 2026-12-02, docs/performance.md.
  QuantizeAppendConfig config = ConfigByRowCount(max_rows);
  config.block_ranges = false;
  const int decode_rows_per_warp = max_rows >= 128 ? 8 : max_rows >= 32 ? 2 : 1;
  config.rows_per_warp = std::max(config.rows_per_warp, decode_rows_per_warp);
  return config;
}

absl::Status QuantizeAppendLayers(const QuantizeAppendParams* layers, int count, cudaStream_t stream) {
  return LaunchLayers(layers, count, nullptr, stream);
}

absl::Status QuantizeAppendLayersWithConfig(const QuantizeAppendParams* layers, int count,
                                            const QuantizeAppendConfig& config, cudaStream_t stream) {
  return LaunchLayers(layers, count, &config, stream);
}

absl::Status QuantizeAppendCuda(const TensorView& append_ckv, const TensorView& append_kpe,
                                const TensorView& batch_indices, const TensorView& positions,
                                const TensorView& ckv_cache, const TensorView& ckv_sf_cache,
                                const TensorView& kpe_cache, const TensorView& kv_indices,
                                const TensorView& kv_indptr, const TensorView& kv_last_page_len, double ckv_scale,
                                double kpe_scale, cudaStream_t stream, unsigned int* skipped_rows) {
  absl::StatusOr<QuantizeAppendParams> params =
      MakeQuantizeAppendParams(append_ckv, append_kpe, batch_indices, positions, ckv_cache, ckv_sf_cache, kpe_cache,
                               kv_indices, kv_indptr, kv_last_page_len, ckv_scale, kpe_scale);
  if (!params.ok()) return params.status();
  params->skipped_rows = skipped_rows;
  return QuantizeAppend(*params, stream);
}

}  // namespace mlakv
