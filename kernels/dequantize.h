// Dequantization of stored rows back to float32 (docs/format.md "Decoding"), for reads
// and for measuring quantization error. Rows are contiguous here: gather them
// out of the paged cache first (a row is 256 + 32 + 64 bytes at CkvOffset /
// CkvSfOffset / KpeOffset of its entry).
#pragma once

#include <cstdint>

#include "absl/status/status.h"

typedef struct CUstream_st* cudaStream_t;

namespace mlakv {

struct DequantizeParams {
  const uint8_t* ckv_packed = nullptr;  // [num_rows, 256] packed E2M1
  const uint8_t* ckv_sf = nullptr;      // [num_rows, 32] E4M3 block scales
  const uint8_t* kpe = nullptr;         // [num_rows, 64] E4M3
  int64_t num_rows = 0;
  float* out_ckv = nullptr;  // [num_rows, 512]
  float* out_kpe = nullptr;  // [num_rows, 64]
  float ckv_scale = 1.0f;
  float kpe_scale = 1.0f;
};

// Host memory everywhere.
void DequantizeHost(const DequantizeParams& params);
// Device memory everywhere, enqueued on `stream`.
absl::Status DequantizeCuda(const DequantizeParams& params, cudaStream_t stream);

}  // namespace mlakv
