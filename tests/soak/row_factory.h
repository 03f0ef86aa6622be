// Random fp16/bf16 MLA rows and the bytes the server must store for them.
//
// The expected bytes come from the CPU quantizer of kernels/ (QuantizeRows,
// the same QuantizeAppendHost the cpu backend runs, and the reference the
// CUDA kernel must equal byte for byte), with the layer's fixed scales: each
// row's stored bytes depend only on that row and the scales, so a model can
// hold them per position.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "mlakv/v1/kv_cache.pb.h"
#include "tests/soak/soak_options.h"

namespace mlakv::soak {

// Rows of one layer: what travels and what must be stored.
struct LayerRowsData {
  uint32_t layer = 0;
  std::string ckv;     // rows x 512 elements of the dtype, little-endian
  std::string kpe;     // rows x 64 elements
  std::string stored;  // rows x kEntryBytes: per token ckv_packed | ckv_sf | kpe
};

class RowFactory {
 public:
  explicit RowFactory(std::vector<LayerScale> scales) : scales_(std::move(scales)) {}

  // `rows` random rows for `layer` with their stored bytes.
  absl::StatusOr<LayerRowsData> Make(std::mt19937_64& rng, uint32_t layer, uint32_t rows,
                                     v1::RowDType dtype) const;
  // Random rows without stored bytes, for messages that must never be stored.
  static LayerRowsData MakeUnstored(std::mt19937_64& rng, uint32_t layer, uint32_t rows, v1::RowDType dtype);

 private:
  std::vector<LayerScale> scales_;
};

}  // namespace mlakv::soak
