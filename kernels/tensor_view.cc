#include "kernels/tensor_view.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace mlakv {

int DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kUInt8:
    case DType::kFloat8E4M3:
      return 1;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kInt32: return "int32";
    case DType::kUInt8: return "uint8";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
  }
  return "unknown";
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expect = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expect) return false;
    expect *= shape[d];
  }
  return true;
}

std::string TensorView::DebugString() const {
  return absl::StrCat(DTypeName(dtype), "[", absl::StrJoin(shape.begin(), shape.begin() + ndim, ", "),
                      "] strides [", absl::StrJoin(strides.begin(), strides.begin() + ndim, ", "), "]");
}

TensorView TensorView::Contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = static_cast<int>(shape.size());
  int d = 0;
  for (int64_t s : shape) v.shape[d++] = s;
  int64_t stride = 1;
  for (d = v.ndim - 1; d >= 0; --d) {
    v.strides[d] = stride;
    stride *= v.shape[d];
  }
  return v;
}

TensorView TensorView::Rows(void* data, DType dtype, int64_t rows, int64_t cols, int64_t row_stride) {
  TensorView v = Contiguous(data, dtype, {rows, cols});
  v.strides[0] = row_stride;
  return v;
}

}  // namespace mlakv
