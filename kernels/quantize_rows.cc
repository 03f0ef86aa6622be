#include "kernels/quantize_rows.h"

#include <cuda_runtime_api.h>

#include <numeric>

#include "common/status_macros.h"
#include "kernels/cuda_check.h"
#include "kernels/dequantize.h"
#include "kernels/quantize_append.h"
#include "kernels/scoped_cuda_device.h"

namespace mlakv {
namespace {

// Device memory freed on every path.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  absl::Status Allocate(size_t bytes) {
    return CudaStatus(cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)), absl::StrCat("cudaMalloc of ", bytes, " bytes"));
  }
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

}  // namespace

int CudaDeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

absl::StatusOr<QuantizedRows> QuantizeRows(const TensorView& ckv, const TensorView& kpe, double ckv_scale,
                                           double kpe_scale, KernelDevice device, int cuda_device) {
  const int64_t n = ckv.ndim == 2 ? ckv.shape[0] : 0;
  if (n > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(n, " rows exceed one call's int32 positions"));
  }
  QuantizedRows out;
  out.rows = n;
  out.ckv_packed.resize(n * format::kCkvPackedBytes);
  out.ckv_sf.resize(n * format::kCkvSfBytes);
  out.kpe.resize(n * format::kKpeBytes);
  std::vector<int32_t> positions(n), batch(n, 0), kv_indices(n);
  std::iota(positions.begin(), positions.end(), 0);
  std::iota(kv_indices.begin(), kv_indices.end(), 0);
  std::vector<int32_t> indptr = {0, static_cast<int32_t>(n)}, last_page_len = {1};

  if (device == KernelDevice::kCpu) {
    absl::Status s = QuantizeAppendCpu(
        ckv, kpe, TensorView::Contiguous(batch.data(), DType::kInt32, {n}),
        TensorView::Contiguous(positions.data(), DType::kInt32, {n}),
        TensorView::Contiguous(out.ckv_packed.data(), DType::kUInt8, {n, 1, format::kCkvPackedBytes}),
        TensorView::Contiguous(out.ckv_sf.data(), DType::kFloat8E4M3, {n, 1, format::kCkvSfBytes}),
        TensorView::Contiguous(out.kpe.data(), DType::kFloat8E4M3, {n, 1, format::kKpeBytes}),
        TensorView::Contiguous(kv_indices.data(), DType::kInt32, {n}),
        TensorView::Contiguous(indptr.data(), DType::kInt32, {2}),
        TensorView::Contiguous(last_page_len.data(), DType::kInt32, {1}), ckv_scale, kpe_scale);
    if (!s.ok()) return s;
    return out;
  }

  ScopedCudaDevice scoped(cuda_device);
  if (!scoped.status().ok()) return scoped.status();
  // Host rows may have a row stride; copy them densely (cudaMemcpy2D keeps the stride on the device).
  const int esize = DTypeSize(ckv.dtype);
  DeviceBuffer d_ckv, d_kpe, d_idx, d_ckv_out, d_sf_out, d_kpe_out;
  const size_t ckv_bytes = n * format::kCkvDim * esize, kpe_bytes = n * format::kKpeDim * esize;
  const size_t idx_bytes = (3 * n + 3) * sizeof(int32_t);
  for (auto [buf, bytes] : {std::pair{&d_ckv, ckv_bytes}, {&d_kpe, kpe_bytes}, {&d_idx, idx_bytes},
                            {&d_ckv_out, out.ckv_packed.size()}, {&d_sf_out, out.ckv_sf.size()},
                            {&d_kpe_out, out.kpe.size()}}) {
    MLAKV_RETURN_IF_ERROR(buf->Allocate(bytes));
  }
  auto copy_rows = [&](void* dst, const TensorView& v, int64_t cols) {
    return CudaStatus(cudaMemcpy2D(dst, cols * esize, v.data, (n > 1 ? v.strides[0] : cols) * esize, cols * esize,
                                   n, cudaMemcpyHostToDevice),
                      "copy rows to device");
  };
  if (n > 0) {
    if (ckv.ndim != 2 || kpe.ndim != 2 || kpe.shape[0] != n || ckv.shape[1] != format::kCkvDim ||
        kpe.shape[1] != format::kKpeDim) {
      return absl::InvalidArgumentError(absl::StrCat("expected ckv [N, 512] and kpe [N, 64], got ", ckv.DebugString(),
                                                     " and ", kpe.DebugString()));
    }
    MLAKV_RETURN_IF_ERROR(copy_rows(d_ckv.get(), ckv, format::kCkvDim));
    MLAKV_RETURN_IF_ERROR(copy_rows(d_kpe.get(), kpe, format::kKpeDim));
  }
  std::vector<int32_t> idx;
  idx.insert(idx.end(), batch.begin(), batch.end());
  idx.insert(idx.end(), positions.begin(), positions.end());
  idx.insert(idx.end(), kv_indices.begin(), kv_indices.end());
  idx.insert(idx.end(), indptr.begin(), indptr.end());
  idx.push_back(1);
  MLAKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(d_idx.get(), idx.data(), idx_bytes, cudaMemcpyHostToDevice), "copy indices");
  auto* d_i32 = static_cast<int32_t*>(d_idx.get());
  absl::Status s = QuantizeAppendCuda(
      TensorView::Contiguous(d_ckv.get(), ckv.dtype, {n, format::kCkvDim}),
      TensorView::Contiguous(d_kpe.get(), kpe.dtype, {n, format::kKpeDim}),
      TensorView::Contiguous(d_i32, DType::kInt32, {n}), TensorView::Contiguous(d_i32 + n, DType::kInt32, {n}),
      TensorView::Contiguous(d_ckv_out.get(), DType::kUInt8, {n, 1, format::kCkvPackedBytes}),
      TensorView::Contiguous(d_sf_out.get(), DType::kFloat8E4M3, {n, 1, format::kCkvSfBytes}),
      TensorView::Contiguous(d_kpe_out.get(), DType::kFloat8E4M3, {n, 1, format::kKpeBytes}),
      TensorView::Contiguous(d_i32 + 2 * n, DType::kInt32, {n}),
      TensorView::Contiguous(d_i32 + 3 * n, DType::kInt32, {2}),
      TensorView::Contiguous(d_i32 + 3 * n + 2, DType::kInt32, {1}), ckv_scale, kpe_scale, /*stream=*/nullptr);
  if (!s.ok()) return s;
  MLAKV_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "QuantizeAppendKernel");
  for (auto [dst, src] : {std::pair{&out.ckv_packed, &d_ckv_out}, {&out.ckv_sf, &d_sf_out}, {&out.kpe, &d_kpe_out}}) {
    MLAKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst->data(), src->get(), dst->size(), cudaMemcpyDeviceToHost),
                               "copy quantized rows to host");
  }
  return out;
}

DequantizedRows DequantizeRows(const QuantizedRows& q, float ckv_scale, float kpe_scale) {
  DequantizedRows d;
  d.ckv.resize(q.rows * format::kCkvDim);
  d.kpe.resize(q.rows * format::kKpeDim);
  DequantizeParams p;
  p.ckv_packed = q.ckv_packed.data();
  p.ckv_sf = q.ckv_sf.data();
  p.kpe = q.kpe.data();
  p.num_rows = q.rows;
  p.out_ckv = d.ckv.data();
  p.out_kpe = d.kpe.data();
  p.ckv_scale = ckv_scale;
  p.kpe_scale = kpe_scale;
  DequantizeHost(p);
  return d;
}

}  // namespace mlakv
