// Non-owning views of tensors handed to the kernels: pointer, shape, strides
// (in elements, as PyTorch counts them) and dtype. A view never owns memory;
// whether `data` is host or device memory is the caller's contract with the
// entry point it calls (QuantizeAppendCpu: host, QuantizeAppendCuda: device).
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace mlakv {

enum class DType : uint8_t {
  kFloat16,
  kBFloat16,
  kFloat32,
  kInt32,
  kUInt8,
  kFloat8E4M3,  // float8_e4m3fn
};

int DTypeSize(DType dtype);
const char* DTypeName(DType dtype);  // "float16", "bfloat16", ...

struct TensorView {
  static constexpr int kMaxDims = 3;

  void* data = nullptr;
  DType dtype = DType::kUInt8;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};  // elements; a contiguous view has strides[ndim-1] == 1

  int64_t numel() const;
  bool is_contiguous() const;
  std::string DebugString() const;  // "bfloat16[48, 512] strides [512, 1]"

  // Contiguous views of 1, 2 or 3 dimensions.
  static TensorView Contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape);
  // A 2-D view whose rows are `row_stride` elements apart (row_stride >= cols).
  static TensorView Rows(void* data, DType dtype, int64_t rows, int64_t cols, int64_t row_stride);
};

}  // namespace mlakv
