// Validation of quantize-append inputs (SPEC "Shapes and layout", "Bounds",
// "Scales"): everything is checked before any byte is written, and every
// message says what was expected and what came.
#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/quantize_append.h"

namespace mlakv {
namespace {

using format::kCkvDim;
using format::kCkvPackedBytes;
using format::kCkvSfBytes;
using format::kKpeBytes;
using format::kKpeDim;

absl::Status Invalid(const char* name, const TensorView& v, const std::string& expected) {
  return absl::InvalidArgumentError(absl::StrCat(name, ": expected ", expected, ", got ", v.DebugString()));
}

absl::Status CheckCache(const char* name, const TensorView& v, DType dtype, int64_t last_dim) {
  const std::string expected = absl::StrCat("contiguous ", DTypeName(dtype), "[num_pages, page_size, ", last_dim, "]");
  if (v.ndim != 3 || v.dtype != dtype || v.shape[2] != last_dim || !v.is_contiguous() || v.data == nullptr) {
    return Invalid(name, v, expected);
  }
  return absl::OkStatus();
}

absl::Status CheckIndex(const char* name, const TensorView& v, int64_t expected_len) {
  if (v.ndim != 1 || v.dtype != DType::kInt32 || (expected_len >= 0 && v.shape[0] != expected_len) ||
      (v.shape[0] > 1 && v.strides[0] != 1) || (v.shape[0] > 0 && v.data == nullptr)) {
    return Invalid(name, v,
                   expected_len >= 0 ? absl::StrCat("contiguous int32[", expected_len, "]") : "contiguous int32[n]");
  }
  return absl::OkStatus();
}

absl::Status CheckRows(const char* name, const TensorView& v, int64_t dim) {
  if (v.ndim != 2 || (v.dtype != DType::kFloat16 && v.dtype != DType::kBFloat16) || v.shape[1] != dim ||
      (v.shape[1] > 1 && v.strides[1] != 1) || (v.shape[0] > 1 && v.strides[0] < dim) ||
      (v.shape[0] > 0 && v.data == nullptr)) {
    return Invalid(name, v,
                   absl::StrCat("float16 or bfloat16 [N, ", dim, "] with a contiguous last dim and row stride >= ", dim,
                                " (only ckv_dim=512, kpe_dim=64 exist)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<float> CheckDecodeScale(double scale, const char* what) {
  // Round to float32 first: a double just above FLT_MAX becomes inf, one just
  // below FLT_MIN a subnormal; both are rejected like the float itself.
  const float f = static_cast<float>(scale);
  if (!(std::isfinite(f) && f >= std::numeric_limits<float>::min())) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " ", scale, " is not a positive normal float32 (expected a finite value in [1.17549435e-38, "
              "3.40282347e+38]; zero, negative, subnormal, infinite and NaN scales are refused)"));
  }
  return f;
}

absl::StatusOr<QuantizeAppendParams> MakeQuantizeAppendParams(
    const TensorView& append_ckv, const TensorView& append_kpe, const TensorView& batch_indices,
    const TensorView& positions, const TensorView& ckv_cache, const TensorView& ckv_sf_cache,
    const TensorView& kpe_cache, const TensorView& kv_indices, const TensorView& kv_indptr,
    const TensorView& kv_last_page_len, double ckv_scale, double kpe_scale) {
  QuantizeAppendParams p;
  MLAKV_ASSIGN_OR_RETURN(float ckv, CheckDecodeScale(ckv_scale, "ckv_scale"));
  MLAKV_ASSIGN_OR_RETURN(float kpe, CheckDecodeScale(kpe_scale, "kpe_scale"));
  p.ckv_scale = ckv;
  p.kpe_scale = kpe;

  MLAKV_RETURN_IF_ERROR(CheckRows("append_ckv", append_ckv, kCkvDim));
  MLAKV_RETURN_IF_ERROR(CheckRows("append_kpe", append_kpe, kKpeDim));
  if (append_kpe.dtype != append_ckv.dtype || append_kpe.shape[0] != append_ckv.shape[0]) {
    return Invalid("append_kpe", append_kpe,
                   absl::StrCat(DTypeName(append_ckv.dtype), "[", append_ckv.shape[0], ", 64] to match append_ckv"));
  }
  const int64_t n = append_ckv.shape[0];
  MLAKV_RETURN_IF_ERROR(CheckIndex("batch_indices", batch_indices, n));
  MLAKV_RETURN_IF_ERROR(CheckIndex("positions", positions, n));

  MLAKV_RETURN_IF_ERROR(CheckCache("ckv_cache", ckv_cache, DType::kUInt8, kCkvPackedBytes));
  MLAKV_RETURN_IF_ERROR(CheckCache("ckv_sf_cache", ckv_sf_cache, DType::kFloat8E4M3, kCkvSfBytes));
  MLAKV_RETURN_IF_ERROR(CheckCache("kpe_cache", kpe_cache, DType::kFloat8E4M3, kKpeBytes));
  const int64_t num_pages = ckv_cache.shape[0], page_size = ckv_cache.shape[1];
  for (const auto& [name, v] : {std::pair<const char*, const TensorView*>{"ckv_sf_cache", &ckv_sf_cache},
                                {"kpe_cache", &kpe_cache}}) {
    if (v->shape[0] != num_pages || v->shape[1] != page_size) {
      return Invalid(name, *v, absl::StrCat("[", num_pages, ", ", page_size, ", ", v->shape[2],
                                            "]: the same num_pages and page_size as ckv_cache"));
    }
  }
  if (page_size <= 0 || page_size > std::numeric_limits<int32_t>::max() ||
      num_pages > std::numeric_limits<int32_t>::max()) {
    return Invalid("ckv_cache", ckv_cache, "page_size >= 1 and num_pages, page_size within int32");
  }

  MLAKV_RETURN_IF_ERROR(CheckIndex("kv_indptr", kv_indptr, -1));
  if (kv_indptr.shape[0] < 1) return Invalid("kv_indptr", kv_indptr, "int32[batch + 1] with batch >= 0");
  const int64_t batch = kv_indptr.shape[0] - 1;
  MLAKV_RETURN_IF_ERROR(CheckIndex("kv_indices", kv_indices, -1));
  MLAKV_RETURN_IF_ERROR(CheckIndex("kv_last_page_len", kv_last_page_len, batch));

  p.append_ckv = append_ckv.data;
  p.append_kpe = append_kpe.data;
  p.ckv_row_stride = n > 1 ? append_ckv.strides[0] : kCkvDim;
  p.kpe_row_stride = n > 1 ? append_kpe.strides[0] : kKpeDim;
  p.dtype = append_ckv.dtype;
  p.batch_indices = static_cast<const int32_t*>(batch_indices.data);
  p.positions = static_cast<const int32_t*>(positions.data);
  p.num_rows = n;
  p.ckv_cache = static_cast<uint8_t*>(ckv_cache.data);
  p.ckv_sf_cache = static_cast<uint8_t*>(ckv_sf_cache.data);
  p.kpe_cache = static_cast<uint8_t*>(kpe_cache.data);
  p.num_pages = static_cast<int32_t>(num_pages);
  p.page_size = static_cast<int32_t>(page_size);
  p.kv_indices = static_cast<const int32_t*>(kv_indices.data);
  p.kv_indptr = static_cast<const int32_t*>(kv_indptr.data);
  p.batch_size = static_cast<int32_t>(batch);
  p.num_kv_indices = kv_indices.shape[0];
  return p;
}

namespace {

// By segment: O(segments + pages touched), no per-row work.
absl::Status ValidateSegmentPlacement(const QuantizeAppendParams& p) {
  if (p.num_segments < 1) {
    return absl::OutOfRangeError(absl::StrCat("num_segments is ", p.num_segments, "; placement by segment needs >= 1"));
  }
  if (p.segment_indptr[0] != 0) {
    return absl::OutOfRangeError(absl::StrCat("segment_indptr[0] is ", p.segment_indptr[0], "; expected 0"));
  }
  for (int32_t s = 0; s < p.num_segments; ++s) {
    const int32_t begin = p.segment_indptr[s], end = p.segment_indptr[s + 1];
    if (end < begin) {
      return absl::OutOfRangeError(absl::StrCat("segment_indptr is not non-decreasing: segment_indptr[", s + 1, "] = ",
                                                end, " < segment_indptr[", s, "] = ", begin));
    }
    if (end == begin) continue;
    // Built only for a message: a decode step validates 256 segments per layer.
    const auto where = [&] { return absl::StrCat("segment ", s, " (rows ", begin, "..", end - 1, ")"); };
    const int32_t b = p.segment_request[s], start = p.segment_start[s];
    if (b < 0 || b >= p.batch_size) {
      return absl::OutOfRangeError(absl::StrCat(where(), ": batch index ", b, " is outside [0, ", p.batch_size, ")"));
    }
    if (start < 0) return absl::OutOfRangeError(absl::StrCat(where(), ": start position ", start, " is negative"));
    const int64_t last = static_cast<int64_t>(start) + (end - begin) - 1;
    if (last > std::numeric_limits<int32_t>::max()) {
      return absl::OutOfRangeError(absl::StrCat(where(), ": positions ", start, "..", last, " overflow int32"));
    }
    const int64_t first_page = p.kv_indptr[b] + start / p.page_size, last_page = p.kv_indptr[b] + last / p.page_size;
    if (last_page >= p.kv_indptr[b + 1]) {
      return absl::OutOfRangeError(absl::StrCat(where(), ": position ", last, " of request ", b, " needs page ",
                                                last / p.page_size, " but the request owns ",
                                                p.kv_indptr[b + 1] - p.kv_indptr[b], " pages of ", p.page_size,
                                                " tokens"));
    }
    for (int64_t i = first_page; i <= last_page; ++i) {
      if (p.kv_indices[i] < 0 || p.kv_indices[i] >= p.num_pages) {
        return absl::OutOfRangeError(absl::StrCat(where(), ": page id ", p.kv_indices[i], " (page ",
                                                  i - p.kv_indptr[b], " of request ", b, ") is outside [0, ",
                                                  p.num_pages, ")"));
      }
    }
  }
  if (p.segment_indptr[p.num_segments] != p.num_rows) {
    return absl::OutOfRangeError(absl::StrCat("segment_indptr[", p.num_segments, "] = ",
                                              p.segment_indptr[p.num_segments], " but num_rows is ", p.num_rows,
                                              "; the segments must cover every row"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateRowPlacement(const QuantizeAppendParams& p) {
  if (p.kv_indptr[0] < 0) {
    return absl::OutOfRangeError(absl::StrCat("kv_indptr[0] is ", p.kv_indptr[0], "; expected >= 0"));
  }
  for (int32_t b = 0; b < p.batch_size; ++b) {
    if (p.kv_indptr[b + 1] < p.kv_indptr[b]) {
      return absl::OutOfRangeError(absl::StrCat("kv_indptr is not non-decreasing: kv_indptr[", b + 1,
                                                "] = ", p.kv_indptr[b + 1], " < kv_indptr[", b,
                                                "] = ", p.kv_indptr[b]));
    }
  }
  if (p.kv_indptr[p.batch_size] > p.num_kv_indices) {
    return absl::OutOfRangeError(absl::StrCat("kv_indptr[", p.batch_size, "] = ", p.kv_indptr[p.batch_size],
                                              " exceeds len(kv_indices) = ", p.num_kv_indices));
  }
  if (p.segment_indptr != nullptr) return ValidateSegmentPlacement(p);
  // The hot loop only finds the first bad row (the server validates every
  // append through here, so it runs once per row of every call: no division
  // when page_size is a power of two, no string work); the message for that
  // row is built afterwards.
  const int32_t page_size = p.page_size;
  const bool pow2 = (page_size & (page_size - 1)) == 0;
  const int shift = pow2 ? __builtin_ctz(static_cast<unsigned>(page_size)) : 0;
  int64_t bad = -1;
  for (int64_t i = 0; i < p.num_rows; ++i) {
    const int32_t b = p.batch_indices[i], pos = p.positions[i];
    if (static_cast<uint32_t>(b) >= static_cast<uint32_t>(p.batch_size) || pos < 0) {
      bad = i;
      break;
    }
    const int32_t page_index = pow2 ? pos >> shift : pos / page_size;
    const int32_t begin = p.kv_indptr[b];
    if (page_index >= p.kv_indptr[b + 1] - begin ||
        static_cast<uint32_t>(p.kv_indices[begin + page_index]) >= static_cast<uint32_t>(p.num_pages)) {
      bad = i;
      break;
    }
  }
  if (bad >= 0) {
    const int64_t i = bad;
    const int32_t b = p.batch_indices[i], pos = p.positions[i];
    if (b < 0 || b >= p.batch_size) {
      return absl::OutOfRangeError(
          absl::StrCat("row ", i, ": batch index ", b, " is outside [0, ", p.batch_size, ")"));
    }
    if (pos < 0) return absl::OutOfRangeError(absl::StrCat("row ", i, ": position ", pos, " is negative"));
    const int64_t pages = p.kv_indptr[b + 1] - p.kv_indptr[b];
    if (pos / p.page_size >= pages) {
      return absl::OutOfRangeError(absl::StrCat("row ", i, ": position ", pos, " of request ", b,
                                                " needs page ", pos / p.page_size, " but the request owns ", pages,
                                                " pages of ", p.page_size, " tokens"));
    }
    const int32_t page = p.kv_indices[p.kv_indptr[b] + pos / p.page_size];
    return absl::OutOfRangeError(absl::StrCat("row ", i, ": page id ", page, " is outside [0, ", p.num_pages, ")"));
  }
  return absl::OkStatus();
}

}  // namespace mlakv
