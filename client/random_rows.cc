#include "client/random_rows.h"

#include <cmath>
#include <random>
#include <string_view>

#include "common/status_macros.h"
#include "kernels/nvfp4_format.h"

namespace mlakv {
namespace {

float ToFloat(uint16_t bits, DType dtype) {
  return dtype == DType::kBFloat16 ? format::Bf16BitsToFloat(bits) : format::HalfBitsToFloat(bits);
}

// Fills `out` and returns the largest magnitude written.
float Fill(std::vector<uint16_t>& out, size_t count, DType dtype, float amax, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> value(-amax, amax);
  out.resize(count);
  float largest = 0;
  for (uint16_t& v : out) {
    const float x = value(rng);
    v = dtype == DType::kBFloat16 ? format::FloatToBf16Bits(x) : format::FloatToHalfBits(x);
    largest = std::max(largest, std::fabs(ToFloat(v, dtype)));
  }
  return largest;
}

std::string_view Bytes(const std::vector<uint16_t>& v) {
  return std::string_view(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(uint16_t));
}

}  // namespace

RowFile MakeRandomRows(int64_t rows, DType dtype, float amax, uint64_t seed) {
  std::mt19937_64 rng(seed);
  RowFile out;
  out.dtype = dtype;
  out.rows = rows;
  const float ckv_max = Fill(out.ckv, static_cast<size_t>(rows) * 512, dtype, amax, rng);
  const float kpe_max = Fill(out.kpe, static_cast<size_t>(rows) * 64, dtype, amax, rng);
  out.ckv_scale = ckv_max > 0 ? ckv_max / (6.0f * 448.0f) : 1.0f;
  out.kpe_scale = kpe_max > 0 ? kpe_max / 448.0f : 1.0f;
  return out;
}

absl::Status WriteRowFile(const std::string& path, const RowFile& rows) {
  SafetensorsWriter w;
  const char* dtype = rows.dtype == DType::kBFloat16 ? "BF16" : "F16";
  MLAKV_RETURN_IF_ERROR(w.Add("ckv", dtype, {rows.rows, 512}, Bytes(rows.ckv)));
  MLAKV_RETURN_IF_ERROR(w.Add("kpe", dtype, {rows.rows, 64}, Bytes(rows.kpe)));
  for (auto [name, value] : {std::pair{"ckv_scale", rows.ckv_scale}, {"kpe_scale", rows.kpe_scale}}) {
    if (!value) continue;
    const float v = *value;
    MLAKV_RETURN_IF_ERROR(w.Add(name, "F32", {1}, std::string_view(reinterpret_cast<const char*>(&v), sizeof(v))));
  }
  return w.Write(path);
}

}  // namespace mlakv
