// Shared by the region tests (server_region_test, server_cuda_region_test,
// server_multi_gpu_test): row sizes and scales, region references, Append and
// AppendBatch messages whose rows are named by reference, the producer's
// buffer layout, and the check of a batch sequence against a bytes append.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/quantize_rows.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"
#include "tests/server/rpc/service_fixture.h"

namespace mlakv::server::testing {

// Bytes of one bf16 / fp16 input row.
inline constexpr uint64_t kCkvRow = 512 * 2;
inline constexpr uint64_t kKpeRow = 64 * 2;
// The scales every region test appends with (by reference and as bytes).
inline constexpr float kCkvScale = 0.0625f;
inline constexpr float kKpeScale = 0.03125f;

v1::RegionRef Ref(const std::string& region, uint64_t offset, uint64_t stride = 0);

// An Append message (first of its stream: it names `sequence` and `pool`)
// whose `layers` take their rows from `ckv` / `kpe` instead of carrying bytes.
v1::AppendRequest RegionMessage(const std::string& sequence, uint32_t start, uint32_t rows, DType dtype,
                                const std::vector<uint32_t>& layers, const v1::RegionRef& ckv,
                                const v1::RegionRef& kpe, const std::string& pool = "");

// Adds sequence `sequence` with `rows` rows of one layer, `layer`, to `req`
// (scales set); the caller fills in the rows (references or bytes).
v1::LayerRows* AddBatchLayer(v1::AppendBatchRequest& req, const std::string& sequence, uint32_t rows,
                             uint32_t layer);

// Rows [i * stride, i * stride + kCkvRow + kKpeRow) of `out` get row i's ckv
// then its kpe; the rest of each stride is left as it is.
void WriteStridedRows(const Rows& rows, uint8_t* out, uint64_t stride);

// A producer's buffer holding `rows` twice:
// [packed ckv rows][packed kpe rows][strided rows: ckv, kpe, 64 pad].
struct ProducerLayout {
  std::string bytes;
  uint64_t kpe_off = 0;      // the packed kpe rows (the packed ckv rows are at 0)
  uint64_t strided_off = 0;  // the first strided row
  uint64_t stride = 0;       // kCkvRow + kKpeRow + 64
};
ProducerLayout MakeProducerLayout(const Rows& rows);

// `part` (`count` rows) stores exactly rows [first, first + count) of `whole`.
void ExpectRowsOf(const QuantizedRows& part, const QuantizedRows& whole, uint64_t first, uint64_t count);

}  // namespace mlakv::server::testing
