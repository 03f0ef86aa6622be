// Random row files (client/random_rows.h, `mlakv make-rows`): the float ->
// bf16/fp16 rounding checked on every finite value of each format and on
// every midpoint between neighbours; the rows, their range and scales; a
// file that LoadRowFile reads back unchanged.
#include "client/random_rows.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <unistd.h>

#include "gtest/gtest.h"
#include "kernels/nvfp4_format.h"

namespace mlakv {
namespace {

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

TEST(RandomRows, Bf16RoundingIsNearestEvenOnEveryValueAndMidpoint) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint32_t bits = h << 16;
    const float x = FromBits(bits);
    if (!std::isfinite(x)) continue;
    ASSERT_EQ(FloatToBf16Bits(x), h) << std::hex << h;
    // The midpoint to the next pattern (same sign, larger magnitude).
    if (((h + 1) & 0x7f80) == 0x7f80) continue;  // the next one is inf/nan
    const float mid = FromBits(bits | 0x8000);
    ASSERT_EQ(FloatToBf16Bits(mid), (h & 1) ? h + 1 : h) << std::hex << h;
    // Just above the midpoint rounds away.
    ASSERT_EQ(FloatToBf16Bits(FromBits(bits | 0x8001)), h + 1) << std::hex << h;
  }
}

TEST(RandomRows, HalfRoundingIsNearestEvenOnEveryNormalValueAndMidpoint) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint32_t exponent = (h >> 10) & 0x1f;
    if (exponent == 0 || exponent == 0x1f) continue;  // subnormals flush; inf/nan not produced
    const float x = format::HalfBitsToFloat(static_cast<uint16_t>(h));
    ASSERT_EQ(FloatToHalfBits(x), h) << std::hex << h;
    if (((h + 1) >> 10 & 0x1f) == 0x1f) continue;
    const float next = format::HalfBitsToFloat(static_cast<uint16_t>(h + 1));
    const float mid = (x + next) / 2;  // exact in float (fp16 has 11 significant bits)
    ASSERT_EQ(FloatToHalfBits(mid), (h & 1) ? h + 1 : h) << std::hex << h;
    ASSERT_EQ(FloatToHalfBits(std::nextafter(mid, next)), h + 1) << std::hex << h;
  }
  // Under the smallest normal: signed zero.
  EXPECT_EQ(FloatToHalfBits(1e-5f), 0);
  EXPECT_EQ(FloatToHalfBits(-1e-5f), 0x8000);
}

TEST(RandomRows, RowsStayInRangeAndTheScalesFitTheirLargestValues) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    const RowFile rows = MakeRandomRows(64, dtype, 2.5f, 7);
    ASSERT_EQ(rows.ckv.size(), 64u * 512);
    ASSERT_EQ(rows.kpe.size(), 64u * 64);
    float ckv_max = 0, kpe_max = 0;
    auto value = [&](uint16_t b) {
      return dtype == DType::kBFloat16 ? format::Bf16BitsToFloat(b) : format::HalfBitsToFloat(b);
    };
    for (uint16_t b : rows.ckv) ckv_max = std::max(ckv_max, std::fabs(value(b)));
    for (uint16_t b : rows.kpe) kpe_max = std::max(kpe_max, std::fabs(value(b)));
    EXPECT_LE(ckv_max, 2.5f);
    EXPECT_GT(ckv_max, 2.4f);  // uniform over 32k values reaches the edge
    EXPECT_FLOAT_EQ(*rows.ckv_scale, ckv_max / (6.0f * 448.0f));
    EXPECT_FLOAT_EQ(*rows.kpe_scale, kpe_max / 448.0f);
    // The same seed makes the same rows; another seed others.
    EXPECT_EQ(MakeRandomRows(64, dtype, 2.5f, 7).ckv, rows.ckv);
    EXPECT_NE(MakeRandomRows(64, dtype, 2.5f, 8).ckv, rows.ckv);
  }
}

TEST(RandomRows, TheFileReadsBackUnchanged) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("mlakv_random_rows_" + std::to_string(getpid()))).string();
  const RowFile rows = MakeRandomRows(5, DType::kFloat16, 4.0f, 1);
  ASSERT_TRUE(WriteRowFile(path, rows).ok());
  absl::StatusOr<RowFile> back = LoadRowFile(path);
  std::filesystem::remove(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->dtype, DType::kFloat16);
  EXPECT_EQ(back->rows, 5);
  EXPECT_EQ(back->ckv, rows.ckv);
  EXPECT_EQ(back->kpe, rows.kpe);
  EXPECT_EQ(back->ckv_scale, rows.ckv_scale);
  EXPECT_EQ(back->kpe_scale, rows.kpe_scale);
}

}  // namespace
}  // namespace mlakv
