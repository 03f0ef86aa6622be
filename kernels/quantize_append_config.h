// Launch configurations of the CUDA quantize-append kernel. The launcher
// (QuantizeAppend) picks one from the row count; benchmarks sweep them.
#pragma once

#include "absl/status/status.h"
#include "kernels/quantize_append.h"

namespace mlakv {

struct QuantizeAppendConfig {
  int rows_per_warp = 1;    // rows per warp iteration, sharing one placement lookup (1, 2, 4, 8)
  int warps_per_block = 8;  // 1..8 warps of 32 threads
  int blocks_per_sm = 8;    // grid cap = blocks_per_sm x SMs; a grid-stride loop covers the rest
};

// The configuration QuantizeAppend uses for `num_rows` rows.
QuantizeAppendConfig DefaultQuantizeAppendConfig(int64_t num_rows);

// Launches with an explicit configuration (INVALID_ARGUMENT if it is not one of the above).
absl::Status QuantizeAppendWithConfig(const QuantizeAppendParams& params, const QuantizeAppendConfig& config,
                                      cudaStream_t stream);

}  // namespace mlakv
