// Dequantize kernel: one thread per output channel pair of ckv (two nibbles of
// one byte) and per kpe channel; rows across blockIdx.y-major flattened grid.
#include <cuda_runtime.h>

#include "kernels/cuda_check.h"
#include "kernels/dequantize.h"
#include "kernels/nvfp4_format.h"

namespace mlakv {
namespace {

using namespace format;

// Thread t of a row: t < 256 decodes packed byte t (channels 2t, 2t+1);
// 256 <= t < 320 decodes kpe channel t - 256.
constexpr int kThreadsPerRow = kCkvPackedBytes + kKpeDim;

__global__ void DequantizeKernel(const DequantizeParams p) {
  const int64_t flat = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = flat / kThreadsPerRow;
  const int t = static_cast<int>(flat % kThreadsPerRow);
  if (row >= p.num_rows) return;
  if (t < kCkvPackedBytes) {
    const uint8_t byte = p.ckv_packed[row * kCkvPackedBytes + t];
    const uint8_t sf = p.ckv_sf[row * kCkvSfBytes + (2 * t) / kBlock];
    float2 out;
    out.x = DequantizeCkv(byte & 0xF, sf, p.ckv_scale);
    out.y = DequantizeCkv(byte >> 4, sf, p.ckv_scale);
    reinterpret_cast<float2*>(p.out_ckv + row * kCkvDim)[t] = out;
  } else {
    const int c = t - kCkvPackedBytes;
    p.out_kpe[row * kKpeDim + c] = DequantizeKpe(p.kpe[row * kKpeBytes + c], p.kpe_scale);
  }
}

}  // namespace

absl::Status DequantizeCuda(const DequantizeParams& p, cudaStream_t stream) {
  if (p.num_rows == 0) return absl::OkStatus();
  constexpr int kThreads = 320;
  const int64_t blocks = (p.num_rows * kThreadsPerRow + kThreads - 1) / kThreads;
  DequantizeKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return CudaStatus(cudaGetLastError(), "DequantizeKernel launch");
}

}  // namespace mlakv
