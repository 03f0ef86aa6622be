// Random row files (client/random_rows.h, `mlakv make-rows`): the rows, their
// range and scales, and a file that LoadRowFile reads back unchanged. (The
// float -> bf16/fp16 rounding is format::FloatToBf16Bits / FloatToHalfBits,
// checked in tests/kernels/nvfp4_format_test.cc.)
#include "client/random_rows.h"

#include <cmath>
#include <filesystem>
#include <unistd.h>

#include "gtest/gtest.h"
#include "kernels/nvfp4_format.h"

namespace mlakv {
namespace {

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
