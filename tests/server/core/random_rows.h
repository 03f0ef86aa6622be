// Random bf16 MLA rows and the entries a pool must store for them: the tests
// of the core model compare what a pool reads back against these.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/nvfp4_format.h"

namespace mlakv::server::testing {

// One stored token of one layer: packed ckv (256), block scales (32), kpe (64).
using Entry = std::array<uint8_t, format::kEntryBytes>;

struct RowSet {
  std::string ckv, kpe;         // [n, 512] / [n, 64] bf16, finite, of varied magnitude
  std::vector<Entry> expected;  // [n], quantized with the given scales (CPU reference)
};

RowSet MakeRows(uint32_t n, uint32_t seed, float ckv_scale, float kpe_scale);

}  // namespace mlakv::server::testing
