#include "tests/server/rpc/region_helpers.h"

#include <gtest/gtest.h>

#include <cstring>

namespace mlakv::server::testing {

v1::RegionRef Ref(const std::string& region, uint64_t offset, uint64_t stride) {
  v1::RegionRef r;
  r.set_region(region);
  r.set_offset(offset);
  r.set_row_stride_bytes(stride);
  return r;
}

v1::AppendRequest RegionMessage(const std::string& sequence, uint32_t start, uint32_t rows, DType dtype,
                                const std::vector<uint32_t>& layers, const v1::RegionRef& ckv,
                                const v1::RegionRef& kpe, const std::string& pool) {
  v1::AppendRequest m;
  m.set_pool(pool);
  m.set_sequence(sequence);
  m.set_start(start);
  m.set_row_count(rows);
  m.set_dtype(ProtoDType(dtype));
  for (uint32_t l : layers) {
    v1::LayerRows* lr = m.add_layers();
    lr->set_layer(l);
    *lr->mutable_ckv_ref() = ckv;
    *lr->mutable_kpe_ref() = kpe;
    lr->set_ckv_scale(kCkvScale);
    lr->set_kpe_scale(kKpeScale);
  }
  return m;
}

v1::LayerRows* AddBatchLayer(v1::AppendBatchRequest& req, const std::string& sequence, uint32_t rows,
                             uint32_t layer) {
  v1::SequenceRows* sr = req.add_sequences();
  sr->set_sequence(sequence);
  sr->set_row_count(rows);
  v1::LayerRows* lr = sr->add_layers();
  lr->set_layer(layer);
  lr->set_ckv_scale(kCkvScale);
  lr->set_kpe_scale(kKpeScale);
  return lr;
}

void WriteStridedRows(const Rows& rows, uint8_t* out, uint64_t stride) {
  for (int64_t i = 0; i < rows.n; ++i) {
    uint8_t* row = out + i * stride;
    std::memcpy(row, rows.ckv.data() + i * 512, kCkvRow);
    std::memcpy(row + kCkvRow, rows.kpe.data() + i * 64, kKpeRow);
  }
}

ProducerLayout MakeProducerLayout(const Rows& rows) {
  ProducerLayout p;
  const uint64_t n = rows.n;
  p.kpe_off = n * kCkvRow;
  p.strided_off = p.kpe_off + n * kKpeRow;
  p.stride = kCkvRow + kKpeRow + 64;
  p.bytes = rows.ckv_bytes() + rows.kpe_bytes();
  p.bytes.resize(p.strided_off + n * p.stride, '\0');
  WriteStridedRows(rows, reinterpret_cast<uint8_t*>(p.bytes.data()) + p.strided_off, p.stride);
  return p;
}

void ExpectRowsOf(const QuantizedRows& part, const QuantizedRows& whole, uint64_t first, uint64_t count) {
  EXPECT_EQ(0, std::memcmp(part.ckv_packed.data(), whole.ckv_packed.data() + first * 256, count * 256))
      << "ckv_packed of rows [" << first << ", " << first + count << ")";
  EXPECT_EQ(0, std::memcmp(part.ckv_sf.data(), whole.ckv_sf.data() + first * 32, count * 32))
      << "ckv_sf of rows [" << first << ", " << first + count << ")";
  EXPECT_EQ(0, std::memcmp(part.kpe.data(), whole.kpe.data() + first * 64, count * 64))
      << "kpe of rows [" << first << ", " << first + count << ")";
}

}  // namespace mlakv::server::testing
