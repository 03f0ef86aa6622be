#include "tests/soak/row_factory.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/quantize_rows.h"
#include "kernels/tensor_view.h"

namespace mlakv::soak {
namespace {

// One 16-bit element. Values are spread over a few binades around 1 with a
// per-row offset, so blocks of 16 channels get different block scales; now
// and then an element is special (zero, subnormal, inf, NaN), which the
// kernel must encode exactly as SPEC.md says on every backend.
uint16_t RandomElement(std::mt19937_64& rng, v1::RowDType dtype, int row_exponent_offset) {
  const uint64_t r = rng();
  const bool bf16 = dtype == v1::ROW_DTYPE_BFLOAT16;
  const int mantissa_bits = bf16 ? 7 : 10;
  const int bias = bf16 ? 127 : 15;
  const int max_exponent = bf16 ? 0xFF : 0x1F;
  const uint16_t sign = static_cast<uint16_t>((r & 1) << 15);
  const uint16_t mantissa = static_cast<uint16_t>((r >> 1) & ((1u << mantissa_bits) - 1));
  int exponent = bias + static_cast<int>((r >> 16) % 10) - 6 + row_exponent_offset;
  if ((r >> 32) % 4096 == 0) {
    switch ((r >> 44) % 4) {
      case 0: exponent = 0; break;                                 // zero or subnormal
      case 1: return static_cast<uint16_t>(sign | (max_exponent << mantissa_bits));  // +-inf
      case 2: return static_cast<uint16_t>(sign | (max_exponent << mantissa_bits) | 1);  // NaN
      default: exponent = bias + 9; break;                         // large: saturates the block scale
    }
  }
  return static_cast<uint16_t>(sign | (exponent << mantissa_bits) | mantissa);
}

std::string RandomRows(std::mt19937_64& rng, uint32_t rows, int dim, v1::RowDType dtype,
                       const std::vector<int>& row_offsets) {
  std::string out(size_t{rows} * dim * 2, '\0');
  for (uint32_t i = 0; i < rows; ++i) {
    for (int c = 0; c < dim; ++c) {
      const uint16_t e = RandomElement(rng, dtype, row_offsets[i]);
      const size_t at = (size_t{i} * dim + c) * 2;
      out[at] = static_cast<char>(e & 0xFF);  // little-endian
      out[at + 1] = static_cast<char>(e >> 8);
    }
  }
  return out;
}

LayerRowsData RandomLayerRows(std::mt19937_64& rng, uint32_t layer, uint32_t rows, v1::RowDType dtype) {
  std::vector<int> offsets(rows);
  for (int& o : offsets) o = static_cast<int>(rng() % 7) - 3;
  LayerRowsData data;
  data.layer = layer;
  data.ckv = RandomRows(rng, rows, format::kCkvDim, dtype, offsets);
  data.kpe = RandomRows(rng, rows, format::kKpeDim, dtype, offsets);
  return data;
}

}  // namespace

LayerRowsData RowFactory::MakeUnstored(std::mt19937_64& rng, uint32_t layer, uint32_t rows, v1::RowDType dtype) {
  return RandomLayerRows(rng, layer, rows, dtype);
}

absl::StatusOr<LayerRowsData> RowFactory::Make(std::mt19937_64& rng, uint32_t layer, uint32_t rows,
                                               v1::RowDType dtype) const {
  if (layer >= scales_.size()) return absl::InternalError(absl::StrCat("row factory: no scales for layer ", layer));
  if (rows == 0) return absl::InternalError("row factory: zero rows");
  LayerRowsData data = RandomLayerRows(rng, layer, rows, dtype);
  const DType kernel_dtype = dtype == v1::ROW_DTYPE_BFLOAT16 ? DType::kBFloat16 : DType::kFloat16;
  const int64_t n = rows;
  absl::StatusOr<QuantizedRows> q = QuantizeRows(TensorView::Contiguous(data.ckv.data(), kernel_dtype, {n, format::kCkvDim}),
                                                 TensorView::Contiguous(data.kpe.data(), kernel_dtype, {n, format::kKpeDim}),
                                                 scales_[layer].ckv, scales_[layer].kpe, KernelDevice::kCpu);
  if (!q.ok()) return q.status();
  data.stored.resize(size_t{rows} * kEntryBytes);
  for (uint32_t i = 0; i < rows; ++i) {
    char* entry = data.stored.data() + size_t{i} * kEntryBytes;
    std::memcpy(entry, q->ckv_packed.data() + size_t{i} * kCkvPackedBytes, kCkvPackedBytes);
    std::memcpy(entry + kCkvPackedBytes, q->ckv_sf.data() + size_t{i} * kCkvSfBytes, kCkvSfBytes);
    std::memcpy(entry + kCkvPackedBytes + kCkvSfBytes, q->kpe.data() + size_t{i} * kKpeBytes, kKpeBytes);
  }
  return data;
}

}  // namespace mlakv::soak
