// Access to ../shared/vectors: the reference inputs and exact expected bytes.
#pragma once

#include <string>
#include <vector>

#include "client/safetensors_file.h"
#include "gtest/gtest.h"
#include "kernels/quantize_rows.h"
#include "kernels/tensor_view.h"

namespace mlakv::testing {

// $MLAKV_VECTORS_DIR, else the path baked in at configure time.
std::string VectorsDir();
// Sorted *.safetensors file names (not paths) in VectorsDir(); empty if none.
std::vector<std::string> VectorFileNames();

// One vector file: rows as aligned copies plus the expected outputs.
struct VectorCase {
  std::string name;
  DType dtype;
  int64_t rows;
  std::vector<uint16_t> ckv, kpe;  // [rows, 512], [rows, 64]
  float ckv_scale, kpe_scale;
  QuantizedRows expect;
  TensorView ckv_view() { return TensorView::Contiguous(ckv.data(), dtype, {rows, 512}); }
  TensorView kpe_view() { return TensorView::Contiguous(kpe.data(), dtype, {rows, 64}); }
};
VectorCase LoadVectorCase(const std::string& file_name);

// "" when equal, else where the first difference is ("ckv_packed row 3 byte 17: 0x4a != 0x4b").
std::string DescribeMismatch(const QuantizedRows& expect, const QuantizedRows& got);

// True when a CUDA device is visible.
bool HaveCuda();

// gtest name of a TEST_P over vector file names: "bf16_edges.safetensors" -> "bf16_edges".
std::string VectorTestName(const ::testing::TestParamInfo<std::string>& info);

}  // namespace mlakv::testing
