// Shared helpers of the in-process server tests: a KvCacheServer on a small
// config, a stub over Server::InProcessChannel, random rows, appends.
#pragma once

#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "kernels/quantize_rows.h"
#include "kernels/tensor_view.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"
#include "server/rpc/kv_cache_server.h"

namespace mlakv::server::testing {

// Random bf16 / fp16 rows (finite values of varied magnitude) as raw bits.
struct Rows {
  DType dtype = DType::kBFloat16;
  int64_t n = 0;
  std::vector<uint16_t> ckv;  // [n, 512]
  std::vector<uint16_t> kpe;  // [n, 64]

  std::string ckv_bytes(int64_t first = 0, int64_t count = -1) const {
    if (count < 0) count = n - first;
    return std::string(reinterpret_cast<const char*>(ckv.data() + first * 512), count * 512 * 2);
  }
  std::string kpe_bytes(int64_t first = 0, int64_t count = -1) const {
    if (count < 0) count = n - first;
    return std::string(reinterpret_cast<const char*>(kpe.data() + first * 64), count * 64 * 2);
  }
  TensorView ckv_view() const {
    return TensorView::Contiguous(const_cast<uint16_t*>(ckv.data()), dtype, {n, 512});
  }
  TensorView kpe_view() const { return TensorView::Contiguous(const_cast<uint16_t*>(kpe.data()), dtype, {n, 64}); }
};

inline uint16_t FloatToBf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

inline Rows RandomRows(int64_t n, uint32_t seed, DType dtype = DType::kBFloat16) {
  Rows r;
  r.dtype = dtype;
  r.n = n;
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-6, 6);
  auto one = [&](float scale) -> uint16_t {
    const float v = normal(gen) * scale;
    if (dtype == DType::kBFloat16) return FloatToBf16Bits(v);
    // fp16: build from a clamped value with round-toward-zero on the mantissa.
    const float c = std::max(-60000.0f, std::min(60000.0f, v));
    uint32_t u;
    std::memcpy(&u, &c, 4);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const int exp = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
    if (exp <= 0) return static_cast<uint16_t>(sign);  // tiny -> signed zero
    return static_cast<uint16_t>(sign | (exp << 10) | ((u >> 13) & 0x3ff));
  };
  for (int64_t i = 0; i < n; ++i) {
    const float row_scale = std::ldexp(1.0f, exponent(gen));
    for (int c = 0; c < 512; ++c) r.ckv.push_back(one(row_scale));
    for (int c = 0; c < 64; ++c) r.kpe.push_back(one(row_scale));
  }
  return r;
}

inline v1::RowDType ProtoDType(DType d) {
  return d == DType::kFloat16 ? v1::ROW_DTYPE_FLOAT16 : v1::ROW_DTYPE_BFLOAT16;
}

// One Append message for rows [first, first + count) of `rows` into `layers`.
inline v1::AppendRequest AppendMessage(const std::string& sequence, uint32_t start, const Rows& rows, int64_t first,
                                       int64_t count, const std::vector<uint32_t>& layers, float ckv_scale = 0.0f,
                                       float kpe_scale = 0.0f) {
  v1::AppendRequest m;
  m.set_sequence(sequence);
  m.set_start(start);
  m.set_row_count(static_cast<uint32_t>(count));
  m.set_dtype(ProtoDType(rows.dtype));
  for (uint32_t l : layers) {
    v1::LayerRows* lr = m.add_layers();
    lr->set_layer(l);
    lr->set_ckv(rows.ckv_bytes(first, count));
    lr->set_kpe(rows.kpe_bytes(first, count));
    lr->set_ckv_scale(ckv_scale);
    lr->set_kpe_scale(kpe_scale);
  }
  return m;
}

inline std::string Describe(const grpc::Status& s) {
  return std::to_string(static_cast<int>(s.error_code())) + " " + s.error_message();
}

// Stored bytes of one layer over [start, start + count), via ReadSequence.
struct Stored {
  grpc::Status status;
  QuantizedRows rows;
  std::vector<float> ckv_float, kpe_float;
  float ckv_scale = 0, kpe_scale = 0;
  int messages = 0;
};

class ServiceFixture {
 public:
  // A server whose only pool is described by `pool_text` (PoolConfig text
  // format, e.g. "num_layers: 4 page_size: 16 num_pages: 32").
  // `listen` non-empty also serves on that address (e.g. "127.0.0.1:0").
  void StartServer(const std::string& device, const std::string& pool_text, const std::string& extra = "",
                   const std::string& listen = "");
  void StopServer() { server_.reset(); }
  // Servers started from now on run with --allow_ipc (regions) or without.
  void set_allow_ipc(bool allow) { allow_ipc_ = allow; }
  // Before StartServer: runs when an Append stream's commit passed its last
  // check, before the pool commits it (KvCacheServer::Options).
  void set_after_last_check(std::function<void()> hook) { after_last_check_ = std::move(hook); }

  v1::KvCache::Stub& stub() { return *stub_; }
  KvCacheServer& server() { return *server_; }
  Pool& pool() { return *server_->pools().front(); }

  // Append as one stream of `messages`; returns the final status.
  grpc::Status Append(const std::vector<v1::AppendRequest>& messages, v1::AppendResponse* resp = nullptr);
  // Append rows [0, n) of `rows` from position `start` into `layers`, in
  // messages of at most `per_message` rows.
  grpc::Status AppendRows(const std::string& sequence, uint32_t start, const Rows& rows,
                          const std::vector<uint32_t>& layers, float ckv_scale = 0.0f, float kpe_scale = 0.0f,
                          int64_t per_message = 1 << 30, v1::AppendResponse* resp = nullptr);
  // Frees `sequence` of the default pool; a failure fails the test.
  void Free(const std::string& sequence);
  // `pool` empty: the default pool.
  Stored Read(const std::string& sequence, uint32_t layer, uint32_t start, uint32_t count, bool dequantize = false,
              uint32_t tokens_per_message = 0, const std::string& pool = "");
  v1::Pool GetPool();
  // Blocks the pool's worker until the returned notification is notified
  // (calls queue up behind it).
  std::unique_ptr<absl::Notification> BlockWorker();
  grpc::Status GetSequence(const std::string& id, v1::Sequence* out);
  // UnregisterRegion of `name` (its response into `out` when given).
  grpc::Status Unregister(const std::string& name, v1::UnregisterRegionResponse* out = nullptr);
  // Sequence `a` (in pool `pool_a`) and sequence `b` (in `pool_b`) store the
  // same bytes in positions [0, count) of each of `layers`.
  void ExpectSameStored(const std::string& a, const std::string& b, const std::vector<uint32_t>& layers,
                        uint32_t count, const std::string& pool_a = "", const std::string& pool_b = "");

 private:
  std::unique_ptr<KvCacheServer> server_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  bool allow_ipc_ = false;
  std::function<void()> after_last_check_;
};

}  // namespace mlakv::server::testing
