// Convenience over quantize-append for rows that are not headed for a paged
// cache: quantize N host rows in order into contiguous outputs, on the CPU or
// on a CUDA device (copying in and out). The cache is viewed as N pages of one
// token with the identity page table, so this runs exactly the kernel that
// serves appends. Used by `mlakv quantize` and by tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/tensor_view.h"

namespace mlakv {

struct QuantizedRows {
  int64_t rows = 0;
  std::vector<uint8_t> ckv_packed;  // [rows, 256]
  std::vector<uint8_t> ckv_sf;      // [rows, 32]
  std::vector<uint8_t> kpe;         // [rows, 64]
};

enum class KernelDevice { kCpu, kCuda };

// `ckv` [N, 512] and `kpe` [N, 64] host views (fp16 or bf16). With kCuda the
// kernel runs on `cuda_device`.
absl::StatusOr<QuantizedRows> QuantizeRows(const TensorView& ckv, const TensorView& kpe, double ckv_scale,
                                           double kpe_scale, KernelDevice device, int cuda_device = 0);

// Dequantized float32 rows [N, 512] and [N, 64] (on the CPU).
struct DequantizedRows {
  std::vector<float> ckv;
  std::vector<float> kpe;
};
DequantizedRows DequantizeRows(const QuantizedRows& q, float ckv_scale, float kpe_scale);

// Number of CUDA devices visible (0 when there is no driver or no GPU).
int CudaDeviceCount();

}  // namespace mlakv
