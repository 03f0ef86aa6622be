// Launch configurations of the CUDA quantize-append kernel. The launcher
// (QuantizeAppend) picks one from the row count; benchmarks sweep them.
#pragma once

#include "absl/status/status.h"
#include "kernels/quantize_append.h"

namespace mlakv {

struct QuantizeAppendConfig {
  int rows_per_warp = 1;    // rows per warp iteration, sharing one placement lookup (1, 2, 4, 8, 16)
  int warps_per_block = 8;  // 1..32 warps of 32 threads
  int blocks_per_sm = 8;    // grid cap = blocks_per_sm x SMs; a grid-stride loop covers the rest
  // How rows are dealt to warps:
  //  * false: warp w takes row groups w, w + W, w + 2W, ... (W warps in the
  //    grid). When the groups do not divide evenly, whole blocks (and so some
  //    SMs) get one group per warp less than the others.
  //  * true: block b takes the contiguous rows [b N / B, (b + 1) N / B) (N
  //    rows, B blocks; the counts differ by at most one row) and its warps
  //    take groups of that range in turn, so every SM gets the same share.
  bool block_ranges = false;
};


// The configuration QuantizeAppend uses for `num_rows` rows.
QuantizeAppendConfig DefaultQuantizeAppendConfig(int64_t num_rows);

// Launches with an explicit configuration (INVALID_ARGUMENT if it is not one of the above).
absl::Status QuantizeAppendWithConfig(const QuantizeAppendParams& params, const QuantizeAppendConfig& config,
                                      cudaStream_t stream);

// The configuration QuantizeAppendLayers uses for layers of up to `max_rows` rows.
QuantizeAppendConfig DefaultQuantizeAppendLayersConfig(int64_t max_rows);

// QuantizeAppendLayers with an explicit configuration (block_ranges is ignored
// there: each grid row is one layer, its rows dealt by warp).
absl::Status QuantizeAppendLayersWithConfig(const QuantizeAppendParams* layers, int count,
                                            const QuantizeAppendConfig& config, cudaStream_t stream);

}  // namespace mlakv
