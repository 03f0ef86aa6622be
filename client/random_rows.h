// Random MLA rows for examples and smoke tests (`mlakv make-rows`): ckv
// [N, 512] and kpe [N, 64] uniform in [-amax, amax], rounded to the nearest
// bf16 or fp16 (format::FloatToBf16Bits / FloatToHalfBits), with the global
// scales the rows are calibrated for
// (docs/format.md): ckv_scale = amax_ckv / (6 x 448), so that the largest
// block's E4M3 scale is 448, and kpe_scale = amax_kpe / 448.
#pragma once

#include <cstdint>

#include "client/row_file.h"

namespace mlakv {

RowFile MakeRandomRows(int64_t rows, DType dtype, float amax, uint64_t seed);
// Writes ckv, kpe (the file's dtype) and the F32 [1] scalars ckv_scale and
// kpe_scale when set: the file `mlakv append --input` and `quantize` read.
absl::Status WriteRowFile(const std::string& path, const RowFile& rows);

}  // namespace mlakv
