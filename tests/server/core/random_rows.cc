#include "tests/server/core/random_rows.h"

#include <cstring>
#include <random>

#include "kernels/quantize_rows.h"

namespace mlakv::server::testing {

RowSet MakeRows(uint32_t n, uint32_t seed, float ckv_scale, float kpe_scale) {
  RowSet r;
  r.ckv.resize(size_t{n} * 1024);
  r.kpe.resize(size_t{n} * 128);
  std::mt19937 gen(seed);
  for (std::string* s : {&r.ckv, &r.kpe}) {
    for (size_t i = 0; i < s->size(); i += 2) {
      (*s)[i] = static_cast<char>(gen());
      (*s)[i + 1] = static_cast<char>(0x3c + gen() % 6 + (gen() % 2 ? 0x80 : 0));  // +-2^-7 .. 2^4
    }
  }
  if (n == 0) return r;
  const TensorView ckv = TensorView::Contiguous(r.ckv.data(), DType::kBFloat16, {n, 512});
  const TensorView kpe = TensorView::Contiguous(r.kpe.data(), DType::kBFloat16, {n, 64});
  absl::StatusOr<QuantizedRows> q = QuantizeRows(ckv, kpe, ckv_scale, kpe_scale, KernelDevice::kCpu);
  if (!q.ok()) return r;  // expected stays empty: every comparison fails
  r.expected.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    std::memcpy(r.expected[i].data(), q->ckv_packed.data() + i * 256, 256);
    std::memcpy(r.expected[i].data() + 256, q->ckv_sf.data() + i * 32, 32);
    std::memcpy(r.expected[i].data() + 288, q->kpe.data() + i * 64, 64);
  }
  return r;
}

}  // namespace mlakv::server::testing
