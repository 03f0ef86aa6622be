#include "tests/testing/paged_scenario.h"

#include "kernels/nvfp4_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>

namespace mlakv::testing {
namespace {

uint16_t FloatToBits(float f, DType dtype) {
  return dtype == DType::kBFloat16 ? format::FloatToBf16Bits(f) : format::FloatToHalfBits(f);
}

}  // namespace

void FillRandomRows(std::mt19937& rng, DType dtype, int64_t rows, int64_t cols, int64_t stride, bool random_bits,
                    std::vector<uint16_t>& out) {
  out.assign(rows * stride, 0x7E7E);  // padding between rows holds NaN-ish junk the kernel must not read
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_mag(-12.0f, 10.0f);
  std::uniform_int_distribution<int> kind(0, 9);
  std::uniform_int_distribution<uint32_t> bits(0, 0xFFFF);
  for (int64_t r = 0; r < rows; ++r) {
    const int k = kind(rng);
    const float mag = std::exp2(log_mag(rng));
    for (int64_t c = 0; c < cols; ++c) {
      uint16_t v;
      if (random_bits && k == 0) {
        v = static_cast<uint16_t>(bits(rng));
      } else if (k == 1 && (c / 16) % 3 == 0) {
        v = 0;  // whole zero blocks
      } else {
        // a few channels far hotter than the rest, as in real latents
        const float hot = (c % 37 == 5) ? 40.0f : 1.0f;
        v = FloatToBits(gauss(rng) * mag * hot, dtype);
      }
      out[r * stride + c] = v;
    }
  }
}

PagedScenario MakeScenario(const ScenarioOptions& o) {
  PagedScenario s;
  s.options = o;
  std::mt19937 rng(o.seed);
  std::uniform_int_distribution<int> new_len(1, std::max(1, o.max_new_tokens));
  std::uniform_int_distribution<int> prefix_len(0, std::max(0, o.max_prefix_tokens));
  std::vector<int> prefix(o.batch), added(o.batch), pages(o.batch);
  int total_pages = 0;
  for (int b = 0; b < o.batch; ++b) {
    prefix[b] = prefix_len(rng);
    added[b] = new_len(rng);
    pages[b] = (prefix[b] + added[b] + o.page_size - 1) / o.page_size;
    total_pages += pages[b];
    s.num_rows += added[b];
  }
  s.num_pages = total_pages + o.spare_pages;
  std::vector<int32_t> ids(s.num_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  s.kv_indptr.push_back(0);
  for (int b = 0; b < o.batch; ++b) {
    for (int i = 0; i < pages[b]; ++i) s.kv_indices.push_back(ids[s.kv_indices.size()]);
    s.kv_indptr.push_back(static_cast<int32_t>(s.kv_indices.size()));
    const int len = prefix[b] + added[b];
    s.kv_last_page_len.push_back(len - (pages[b] - 1) * o.page_size);
    for (int t = 0; t < added[b]; ++t) {
      s.batch_indices.push_back(b);
      s.positions.push_back(prefix[b] + t);
    }
  }
  if (o.shuffle_rows) {
    std::vector<size_t> order(s.num_rows);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int32_t> b2(s.num_rows), p2(s.num_rows);
    for (int64_t i = 0; i < s.num_rows; ++i) {
      b2[i] = s.batch_indices[order[i]];
      p2[i] = s.positions[order[i]];
    }
    s.batch_indices.swap(b2);
    s.positions.swap(p2);
  }
  s.ckv_row_stride = 512 + o.extra_row_stride;
  s.kpe_row_stride = 64 + o.extra_row_stride;
  FillRandomRows(rng, o.dtype, s.num_rows, 512, s.ckv_row_stride, o.random_bit_rows, s.ckv);
  FillRandomRows(rng, o.dtype, s.num_rows, 64, s.kpe_row_stride, o.random_bit_rows, s.kpe);
  std::uniform_real_distribution<float> log_scale(-16.0f, 4.0f);
  s.ckv_scale = std::exp2(log_scale(rng));
  s.kpe_scale = std::exp2(log_scale(rng));
  s.ckv_cache.assign(static_cast<size_t>(s.num_pages) * o.page_size * 256, kPoison);
  s.ckv_sf_cache.assign(static_cast<size_t>(s.num_pages) * o.page_size * 32, kPoison);
  s.kpe_cache.assign(static_cast<size_t>(s.num_pages) * o.page_size * 64, kPoison);
  return s;
}

absl::Status PagedScenario::RunCpu() {
  return QuantizeAppendCpu(ckv_view(), kpe_view(), i32(batch_indices), i32(positions), ckv_cache_view(),
                           sf_cache_view(), kpe_cache_view(), i32(kv_indices), i32(kv_indptr), i32(kv_last_page_len),
                           ckv_scale, kpe_scale);
}

QuantizeAppendParams PagedScenario::HostParams() {
  return MakeQuantizeAppendParams(ckv_view(), kpe_view(), i32(batch_indices), i32(positions), ckv_cache_view(),
                                  sf_cache_view(), kpe_cache_view(), i32(kv_indices), i32(kv_indptr),
                                  i32(kv_last_page_len), ckv_scale, kpe_scale)
      .value();
}

void PagedScenario::BuildSegments(std::mt19937* split_rng) {
  segment_indptr.assign(1, 0);
  segment_request.clear();
  segment_start.clear();
  for (int64_t i = 0; i < num_rows; ++i) {
    const bool continues = i > 0 && batch_indices[i] == batch_indices[i - 1] &&
                           positions[i] == positions[i - 1] + 1 &&
                           !(split_rng != nullptr && (*split_rng)() % 7 == 0);
    if (!continues) {
      if (i > 0) segment_indptr.push_back(static_cast<int32_t>(i));
      segment_request.push_back(batch_indices[i]);
      segment_start.push_back(positions[i]);
    }
  }
  if (num_rows > 0) segment_indptr.push_back(static_cast<int32_t>(num_rows));
}

QuantizeAppendParams PagedScenario::SegmentHostParams() {
  QuantizeAppendParams p = HostParams();
  p.batch_indices = nullptr;
  p.positions = nullptr;
  p.segment_indptr = segment_indptr.data();
  p.segment_request = segment_request.data();
  p.segment_start = segment_start.data();
  p.num_segments = static_cast<int32_t>(segment_request.size());
  return p;
}

std::vector<int64_t> PagedScenario::AddressedEntries() const {
  std::set<int64_t> entries;
  for (int64_t i = 0; i < num_rows; ++i) {
    const int b = batch_indices[i], p = positions[i];
    entries.insert(static_cast<int64_t>(kv_indices[kv_indptr[b] + p / options.page_size]) * options.page_size +
                   p % options.page_size);
  }
  return {entries.begin(), entries.end()};
}

}  // namespace mlakv::testing
