// Row files: safetensors holding MLA rows to append — `ckv` [N, 512] and `kpe`
// [N, 64], both BF16 or both F16, and optionally the F32 scalars `ckv_scale`
// and `kpe_scale` — and the quantized files `mlakv quantize` / `mlakv export`
// write: `ckv_packed` U8 [N, 256], `ckv_sf` F8_E4M3 [N, 32], `kpe` F8_E4M3 [N, 64].
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/safetensors_file.h"
#include "kernels/quantize_rows.h"
#include "kernels/tensor_view.h"

namespace mlakv {

struct RowFile {
  DType dtype = DType::kBFloat16;
  int64_t rows = 0;
  std::vector<uint16_t> ckv;  // [rows, 512] raw fp16/bf16 bits, aligned copies of the file's bytes
  std::vector<uint16_t> kpe;  // [rows, 64]
  std::optional<float> ckv_scale;
  std::optional<float> kpe_scale;

  TensorView ckv_view() { return TensorView::Contiguous(ckv.data(), dtype, {rows, 512}); }
  TensorView kpe_view() { return TensorView::Contiguous(kpe.data(), dtype, {rows, 64}); }
};

absl::StatusOr<RowFile> LoadRowFile(const std::string& path);
// The rows of an already parsed safetensors file (what LoadRowFile does after
// reading it); errors name file.name().
absl::StatusOr<RowFile> RowFileFromSafetensors(const SafetensorsFile& file);

// Adds ckv_packed U8 [N, 256], ckv_sf F8_E4M3 [N, 32] and kpe F8_E4M3 [N, 64].
absl::Status AddQuantizedTensors(const QuantizedRows& rows, SafetensorsWriter& writer);

// Writes ckv_packed / ckv_sf / kpe in row order, with `metadata`.
absl::Status WriteQuantizedFile(const std::string& path, const QuantizedRows& rows,
                                const std::map<std::string, std::string>& metadata);

}  // namespace mlakv
