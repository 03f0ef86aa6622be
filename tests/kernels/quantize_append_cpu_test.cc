// The CPU quantize-append: reference vectors byte for byte, placement into
// paged caches (only addressed bytes change), and every rejection rule of
// docs/format.md, each writing nothing.
#include <cmath>
#include <cstring>
#include <limits>

#include "gtest/gtest.h"
#include "kernels/quantize_append.h"
#include "kernels/quantize_append_config.h"
#include "kernels/quantize_rows.h"
#include "tests/testing/paged_scenario.h"
#include "tests/testing/vector_files.h"

namespace mlakv {
namespace {

using testing::kPoison;
using testing::LoadVectorCase;
using testing::MakeScenario;
using testing::PagedScenario;
using testing::ScenarioOptions;
using testing::VectorFileNames;

TEST(Vectors, DirectoryHoldsFiles) {
  ASSERT_FALSE(VectorFileNames().empty()) << "no *.safetensors in " << testing::VectorsDir()
                                          << " (set MLAKV_VECTORS_DIR)";
}

class CpuVectorTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CpuVectorTest, MatchesExpectedBytes) {
  testing::VectorCase c = LoadVectorCase(GetParam());
  absl::StatusOr<QuantizedRows> q =
      QuantizeRows(c.ckv_view(), c.kpe_view(), c.ckv_scale, c.kpe_scale, KernelDevice::kCpu);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(testing::DescribeMismatch(c.expect, *q), "");
}

// The same rows placed through a paged table (page size 16, shuffled pages,
// rows in reverse order): gathering each row's entry gives the same bytes.
TEST_P(CpuVectorTest, MatchesExpectedBytesThroughShuffledPages) {
  testing::VectorCase c = LoadVectorCase(GetParam());
  const int page_size = 16;
  const int pages = static_cast<int>((c.rows + page_size - 1) / page_size);
  std::vector<int32_t> kv_indices(pages), indptr = {0, pages}, last = {static_cast<int32_t>(c.rows - (pages - 1) * page_size)};
  // Odd page ids in reverse order; the even ones stay unowned.
  for (int i = 0; i < pages; ++i) kv_indices[i] = 2 * (pages - 1 - i) + 1;
  std::vector<int32_t> batch(c.rows, 0), pos(c.rows);
  for (int64_t i = 0; i < c.rows; ++i) pos[i] = static_cast<int32_t>(i);
  // reverse the row order: row i of the views is position rows-1-i
  std::vector<uint16_t> ckv(c.ckv.size()), kpe(c.kpe.size());
  for (int64_t i = 0; i < c.rows; ++i) {
    std::memcpy(&ckv[i * 512], &c.ckv[(c.rows - 1 - i) * 512], 1024);
    std::memcpy(&kpe[i * 64], &c.kpe[(c.rows - 1 - i) * 64], 128);
    pos[i] = static_cast<int32_t>(c.rows - 1 - i);
  }
  const int num_pages = 2 * pages + 1;
  std::vector<uint8_t> ckv_cache(num_pages * page_size * 256, kPoison), sf(num_pages * page_size * 32, kPoison),
      kc(num_pages * page_size * 64, kPoison);
  auto i32 = [](std::vector<int32_t>& v) {
    return TensorView::Contiguous(v.data(), DType::kInt32, {static_cast<int64_t>(v.size())});
  };
  absl::Status s = QuantizeAppendCpu(
      TensorView::Contiguous(ckv.data(), c.dtype, {c.rows, 512}), TensorView::Contiguous(kpe.data(), c.dtype, {c.rows, 64}),
      i32(batch), i32(pos), TensorView::Contiguous(ckv_cache.data(), DType::kUInt8, {num_pages, page_size, 256}),
      TensorView::Contiguous(sf.data(), DType::kFloat8E4M3, {num_pages, page_size, 32}),
      TensorView::Contiguous(kc.data(), DType::kFloat8E4M3, {num_pages, page_size, 64}), i32(kv_indices), i32(indptr),
      i32(last), c.ckv_scale, c.kpe_scale);
  ASSERT_TRUE(s.ok()) << s;
  QuantizedRows got;
  got.rows = c.rows;
  for (int64_t p = 0; p < c.rows; ++p) {
    const int64_t entry = static_cast<int64_t>(kv_indices[p / page_size]) * page_size + p % page_size;
    got.ckv_packed.insert(got.ckv_packed.end(), &ckv_cache[entry * 256], &ckv_cache[entry * 256 + 256]);
    got.ckv_sf.insert(got.ckv_sf.end(), &sf[entry * 32], &sf[entry * 32 + 32]);
    got.kpe.insert(got.kpe.end(), &kc[entry * 64], &kc[entry * 64 + 64]);
  }
  EXPECT_EQ(testing::DescribeMismatch(c.expect, got), "");
}

INSTANTIATE_TEST_SUITE_P(AllFiles, CpuVectorTest, ::testing::ValuesIn(VectorFileNames()),
                         testing::VectorTestName);

// ---- placement: only addressed entries change ------------------------------

struct PlacementCase {
  DType dtype;
  int page_size;
};

class CpuPlacementTest : public ::testing::TestWithParam<PlacementCase> {};

TEST_P(CpuPlacementTest, WritesExactlyTheAddressedEntries) {
  for (uint32_t seed = 1; seed <= 3; ++seed) {
    ScenarioOptions o;
    o.dtype = GetParam().dtype;
    o.page_size = GetParam().page_size;
    o.seed = seed;
    PagedScenario s = MakeScenario(o);
    ASSERT_TRUE(s.RunCpu().ok());
    std::vector<bool> addressed(static_cast<size_t>(s.num_pages) * o.page_size, false);
    for (int64_t e : s.AddressedEntries()) addressed[e] = true;
    // Every row's bytes equal the row quantized on its own (contiguous path).
    for (int64_t i = 0; i < s.num_rows; ++i) {
      const int b = s.batch_indices[i], p = s.positions[i];
      const int64_t entry =
          static_cast<int64_t>(s.kv_indices[s.kv_indptr[b] + p / o.page_size]) * o.page_size + p % o.page_size;
      absl::StatusOr<QuantizedRows> one = QuantizeRows(
          TensorView::Rows(&s.ckv[i * s.ckv_row_stride], o.dtype, 1, 512, 512),
          TensorView::Rows(&s.kpe[i * s.kpe_row_stride], o.dtype, 1, 64, 64), s.ckv_scale, s.kpe_scale,
          KernelDevice::kCpu);
      ASSERT_TRUE(one.ok()) << one.status();
      ASSERT_EQ(0, std::memcmp(&s.ckv_cache[entry * 256], one->ckv_packed.data(), 256)) << "row " << i;
      ASSERT_EQ(0, std::memcmp(&s.ckv_sf_cache[entry * 32], one->ckv_sf.data(), 32)) << "row " << i;
      ASSERT_EQ(0, std::memcmp(&s.kpe_cache[entry * 64], one->kpe.data(), 64)) << "row " << i;
    }
    for (size_t e = 0; e < addressed.size(); ++e) {
      if (addressed[e]) continue;
      for (int j = 0; j < 256; ++j) ASSERT_EQ(s.ckv_cache[e * 256 + j], kPoison) << "entry " << e;
      for (int j = 0; j < 32; ++j) ASSERT_EQ(s.ckv_sf_cache[e * 32 + j], kPoison) << "entry " << e;
      for (int j = 0; j < 64; ++j) ASSERT_EQ(s.kpe_cache[e * 64 + j], kPoison) << "entry " << e;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DTypesAndPageSizes, CpuPlacementTest,
                         ::testing::Values(PlacementCase{DType::kBFloat16, 1}, PlacementCase{DType::kBFloat16, 16},
                                           PlacementCase{DType::kBFloat16, 64}, PlacementCase{DType::kBFloat16, 128},
                                           PlacementCase{DType::kFloat16, 1}, PlacementCase{DType::kFloat16, 16},
                                           PlacementCase{DType::kFloat16, 64}, PlacementCase{DType::kFloat16, 128},
                                           PlacementCase{DType::kBFloat16, 37}),
                         [](const auto& info) {
                           return std::string(info.param.dtype == DType::kBFloat16 ? "bf16" : "f16") + "_page" +
                                  std::to_string(info.param.page_size);
                         });

TEST(CpuThreads, ManyThreadsWriteTheSameBytesAsOne) {
  ScenarioOptions o;
  o.batch = 8;
  o.max_new_tokens = 1500;
  o.page_size = 64;
  PagedScenario a = MakeScenario(o), b = MakeScenario(o);
  QuantizeAppendHost(a.HostParams(), 1);
  QuantizeAppendHost(b.HostParams(), 4);
  EXPECT_EQ(a.ckv_cache, b.ckv_cache);
  EXPECT_EQ(a.ckv_sf_cache, b.ckv_sf_cache);
  EXPECT_EQ(a.kpe_cache, b.kpe_cache);
}

// ---- rejections: an error, and not one byte written -------------------------

class CpuRejectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ScenarioOptions o;
    o.page_size = 16;
    o.seed = 11;
    s_ = MakeScenario(o);
  }
  // Runs with the given overrides and expects `code`, with caches untouched.
  void ExpectRejected(absl::StatusCode code, const std::string& needle, double ckv_scale, double kpe_scale,
                      TensorView ckv, TensorView kpe, TensorView ckv_cache, TensorView sf_cache, TensorView kpe_cache,
                      TensorView last_page_len) {
    const absl::Status st =
        QuantizeAppendCpu(ckv, kpe, s_.i32(s_.batch_indices), s_.i32(s_.positions), ckv_cache, sf_cache, kpe_cache,
                          s_.i32(s_.kv_indices), s_.i32(s_.kv_indptr), last_page_len, ckv_scale, kpe_scale);
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_NE(std::string(st.message()).find(needle), std::string::npos) << "message: " << st.message();
    ExpectUntouched();
  }
  void ExpectRejected(absl::StatusCode code, const std::string& needle) {
    ExpectRejected(code, needle, s_.ckv_scale, s_.kpe_scale, s_.ckv_view(), s_.kpe_view(), s_.ckv_cache_view(),
                   s_.sf_cache_view(), s_.kpe_cache_view(), s_.i32(s_.kv_last_page_len));
  }
  void ExpectScaleRejected(double ckv, double kpe, const std::string& needle) {
    ExpectRejected(absl::StatusCode::kInvalidArgument, needle, ckv, kpe, s_.ckv_view(), s_.kpe_view(),
                   s_.ckv_cache_view(), s_.sf_cache_view(), s_.kpe_cache_view(), s_.i32(s_.kv_last_page_len));
  }
  void ExpectUntouched() {
    for (auto* v : {&s_.ckv_cache, &s_.ckv_sf_cache, &s_.kpe_cache}) {
      for (size_t i = 0; i < v->size(); ++i) ASSERT_EQ((*v)[i], kPoison) << "byte " << i << " was written";
    }
  }
  PagedScenario s_;
};

TEST_F(CpuRejectTest, AcceptsTheUnmodifiedScenario) {
  ASSERT_TRUE(s_.RunCpu().ok());  // the baseline the rejections below perturb
}

TEST_F(CpuRejectTest, RejectsZeroScale) { ExpectScaleRejected(0.0, 1.0, "ckv_scale"); }
TEST_F(CpuRejectTest, RejectsNegativeScale) { ExpectScaleRejected(-1.0, 1.0, "ckv_scale"); }
TEST_F(CpuRejectTest, RejectsSubnormalScale) { ExpectScaleRejected(1e-40, 1.0, "ckv_scale"); }
TEST_F(CpuRejectTest, RejectsInfiniteScale) {
  ExpectScaleRejected(std::numeric_limits<double>::infinity(), 1.0, "ckv_scale");
}
TEST_F(CpuRejectTest, RejectsNanScale) { ExpectScaleRejected(std::nan(""), 1.0, "ckv_scale"); }
TEST_F(CpuRejectTest, RejectsDoubleScaleBeyondFloat32) { ExpectScaleRejected(1e39, 1.0, "ckv_scale"); }
TEST_F(CpuRejectTest, RejectsBadKpeScales) {
  for (double bad : {0.0, -1.0, 1e-40, 1e39, std::numeric_limits<double>::infinity(), std::nan("")}) {
    ExpectScaleRejected(1.0, bad, "kpe_scale");
  }
}
TEST_F(CpuRejectTest, AcceptsExtremeNormalScales) {
  for (double ok : {static_cast<double>(std::numeric_limits<float>::min()),
                    static_cast<double>(std::numeric_limits<float>::max())}) {
    const absl::Status st = QuantizeAppendCpu(
        s_.ckv_view(), s_.kpe_view(), s_.i32(s_.batch_indices), s_.i32(s_.positions), s_.ckv_cache_view(),
        s_.sf_cache_view(), s_.kpe_cache_view(), s_.i32(s_.kv_indices), s_.i32(s_.kv_indptr),
        s_.i32(s_.kv_last_page_len), ok, ok);
    EXPECT_TRUE(st.ok()) << ok << ": " << st;
  }
}

TEST_F(CpuRejectTest, RejectsCkvDimOtherThan512) {
  TensorView ckv = s_.ckv_view();
  ckv.shape[1] = 256;
  ExpectRejected(absl::StatusCode::kInvalidArgument, "append_ckv", s_.ckv_scale, s_.kpe_scale, ckv, s_.kpe_view(),
                 s_.ckv_cache_view(), s_.sf_cache_view(), s_.kpe_cache_view(), s_.i32(s_.kv_last_page_len));
}
TEST_F(CpuRejectTest, RejectsKpeDimOtherThan64) {
  TensorView kpe = s_.kpe_view();
  kpe.shape[1] = 32;
  ExpectRejected(absl::StatusCode::kInvalidArgument, "append_kpe", s_.ckv_scale, s_.kpe_scale, s_.ckv_view(), kpe,
                 s_.ckv_cache_view(), s_.sf_cache_view(), s_.kpe_cache_view(), s_.i32(s_.kv_last_page_len));
}
TEST_F(CpuRejectTest, RejectsFloat32Rows) {
  TensorView ckv = s_.ckv_view();
  ckv.dtype = DType::kFloat32;
  ExpectRejected(absl::StatusCode::kInvalidArgument, "float16 or bfloat16", s_.ckv_scale, s_.kpe_scale, ckv,
                 s_.kpe_view(), s_.ckv_cache_view(), s_.sf_cache_view(), s_.kpe_cache_view(),
                 s_.i32(s_.kv_last_page_len));
}
TEST_F(CpuRejectTest, RejectsMixedRowDtypes) {
  TensorView kpe = s_.kpe_view();
  kpe.dtype = kpe.dtype == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
  ExpectRejected(absl::StatusCode::kInvalidArgument, "to match append_ckv", s_.ckv_scale, s_.kpe_scale, s_.ckv_view(),
                 kpe, s_.ckv_cache_view(), s_.sf_cache_view(), s_.kpe_cache_view(), s_.i32(s_.kv_last_page_len));
}
TEST_F(CpuRejectTest, RejectsRowCountMismatch) {
  TensorView kpe = s_.kpe_view();
  kpe.shape[0] -= 1;
  ExpectRejected(absl::StatusCode::kInvalidArgument, "append_kpe", s_.ckv_scale, s_.kpe_scale, s_.ckv_view(), kpe,
                 s_.ckv_cache_view(), s_.sf_cache_view(), s_.kpe_cache_view(), s_.i32(s_.kv_last_page_len));
}
TEST_F(CpuRejectTest, RejectsRowStrideShorterThanRow) {
  TensorView ckv = s_.ckv_view();
  ckv.strides[0] = 500;
  ExpectRejected(absl::StatusCode::kInvalidArgument, "row stride", s_.ckv_scale, s_.kpe_scale, ckv, s_.kpe_view(),
                 s_.ckv_cache_view(), s_.sf_cache_view(), s_.kpe_cache_view(), s_.i32(s_.kv_last_page_len));
}
TEST_F(CpuRejectTest, RejectsWrongCacheDtype) {
  TensorView sf = s_.sf_cache_view();
  sf.dtype = DType::kUInt8;
  ExpectRejected(absl::StatusCode::kInvalidArgument, "ckv_sf_cache", s_.ckv_scale, s_.kpe_scale, s_.ckv_view(),
                 s_.kpe_view(), s_.ckv_cache_view(), sf, s_.kpe_cache_view(), s_.i32(s_.kv_last_page_len));
}
TEST_F(CpuRejectTest, RejectsCachesWithDifferentPageCounts) {
  TensorView kc = s_.kpe_cache_view();
  kc.shape[0] -= 1;
  kc = TensorView::Contiguous(kc.data, kc.dtype, {kc.shape[0], kc.shape[1], kc.shape[2]});
  ExpectRejected(absl::StatusCode::kInvalidArgument, "same num_pages and page_size", s_.ckv_scale, s_.kpe_scale,
                 s_.ckv_view(), s_.kpe_view(), s_.ckv_cache_view(), s_.sf_cache_view(), kc,
                 s_.i32(s_.kv_last_page_len));
}
TEST_F(CpuRejectTest, RejectsCachesWithDifferentPageSizes) {
  TensorView sf = s_.sf_cache_view();
  sf = TensorView::Contiguous(sf.data, sf.dtype, {sf.shape[0] * 2, sf.shape[1] / 2, 32});
  ExpectRejected(absl::StatusCode::kInvalidArgument, "same num_pages and page_size", s_.ckv_scale, s_.kpe_scale,
                 s_.ckv_view(), s_.kpe_view(), s_.ckv_cache_view(), sf, s_.kpe_cache_view(),
                 s_.i32(s_.kv_last_page_len));
}
TEST_F(CpuRejectTest, RejectsNonContiguousCache) {
  TensorView cc = s_.ckv_cache_view();
  cc.strides[0] *= 2;
  cc.shape[0] /= 2;
  ExpectRejected(absl::StatusCode::kInvalidArgument, "contiguous", s_.ckv_scale, s_.kpe_scale, s_.ckv_view(),
                 s_.kpe_view(), cc, s_.sf_cache_view(), s_.kpe_cache_view(), s_.i32(s_.kv_last_page_len));
}
TEST_F(CpuRejectTest, RejectsLastPageLenOfWrongLength) {
  std::vector<int32_t> last(s_.kv_last_page_len.size() + 1, 1);
  ExpectRejected(absl::StatusCode::kInvalidArgument, "kv_last_page_len", s_.ckv_scale, s_.kpe_scale, s_.ckv_view(),
                 s_.kpe_view(), s_.ckv_cache_view(), s_.sf_cache_view(), s_.kpe_cache_view(), s_.i32(last));
}
TEST_F(CpuRejectTest, RejectsBatchIndexAboveBatch) {
  s_.batch_indices[s_.num_rows / 2] = static_cast<int32_t>(s_.kv_indptr.size() - 1);
  ExpectRejected(absl::StatusCode::kOutOfRange, "batch index");
}
TEST_F(CpuRejectTest, RejectsNegativeBatchIndex) {
  s_.batch_indices[0] = -1;
  ExpectRejected(absl::StatusCode::kOutOfRange, "batch index");
}
TEST_F(CpuRejectTest, RejectsPositionPastTheRequestsPages) {
  const int b = s_.batch_indices[3];
  const int pages = s_.kv_indptr[b + 1] - s_.kv_indptr[b];
  s_.positions[3] = pages * s_.options.page_size;  // first position of a page the request does not own
  ExpectRejected(absl::StatusCode::kOutOfRange, "position");
}
TEST_F(CpuRejectTest, RejectsNegativePosition) {
  s_.positions[1] = -5;
  ExpectRejected(absl::StatusCode::kOutOfRange, "negative");
}
TEST_F(CpuRejectTest, RejectsPageIdAtNumPages) {
  s_.kv_indices[s_.kv_indptr[s_.batch_indices[0]] + s_.positions[0] / s_.options.page_size] = s_.num_pages;
  ExpectRejected(absl::StatusCode::kOutOfRange, "page id");
}
TEST_F(CpuRejectTest, RejectsNegativePageId) {
  s_.kv_indices[s_.kv_indptr[s_.batch_indices[0]] + s_.positions[0] / s_.options.page_size] = -1;
  ExpectRejected(absl::StatusCode::kOutOfRange, "page id");
}
TEST_F(CpuRejectTest, RejectsDecreasingIndptr) {
  std::swap(s_.kv_indptr[1], s_.kv_indptr[2]);
  ExpectRejected(absl::StatusCode::kOutOfRange, "non-decreasing");
}
TEST_F(CpuRejectTest, RejectsIndptrBeyondIndices) {
  s_.kv_indptr.back() += 1;
  ExpectRejected(absl::StatusCode::kOutOfRange, "exceeds len(kv_indices)");
}

// ---- placement by segment (QuantizeAppendParams' second form) ----------------

struct SegmentCase {
  DType dtype;
  int page_size;
  bool shuffle_rows;  // shuffled rows: mostly one-row segments
  bool split;         // cut runs at random points: several segments per request
};

class CpuSegmentTest : public ::testing::TestWithParam<SegmentCase> {};

TEST_P(CpuSegmentTest, WritesTheSameBytesAsPerRowPlacement) {
  for (uint32_t seed = 1; seed <= 3; ++seed) {
    ScenarioOptions o;
    o.dtype = GetParam().dtype;
    o.page_size = GetParam().page_size;
    o.shuffle_rows = GetParam().shuffle_rows;
    o.seed = seed;
    PagedScenario per_row = MakeScenario(o), by_segment = MakeScenario(o);
    std::mt19937 split_rng(seed);
    by_segment.BuildSegments(GetParam().split ? &split_rng : nullptr);
    if (!o.shuffle_rows && !GetParam().split) {
      EXPECT_EQ(by_segment.segment_request.size(), static_cast<size_t>(o.batch)) << "one run per request";
    }
    ASSERT_TRUE(per_row.RunCpu().ok());
    const QuantizeAppendParams p = by_segment.SegmentHostParams();
    ASSERT_TRUE(ValidateRowPlacement(p).ok()) << ValidateRowPlacement(p);
    QuantizeAppendHost(p, 2);
    EXPECT_EQ(by_segment.ckv_cache, per_row.ckv_cache) << "seed " << seed;
    EXPECT_EQ(by_segment.ckv_sf_cache, per_row.ckv_sf_cache) << "seed " << seed;
    EXPECT_EQ(by_segment.kpe_cache, per_row.kpe_cache) << "seed " << seed;
  }
}

INSTANTIATE_TEST_SUITE_P(Forms, CpuSegmentTest,
                         ::testing::Values(SegmentCase{DType::kBFloat16, 64, false, false},
                                           SegmentCase{DType::kBFloat16, 16, false, true},
                                           SegmentCase{DType::kFloat16, 1, false, true},
                                           SegmentCase{DType::kFloat16, 37, true, false},
                                           SegmentCase{DType::kBFloat16, 128, true, true}),
                         [](const auto& info) {
                           return std::string(info.param.dtype == DType::kBFloat16 ? "bf16" : "f16") + "_page" +
                                  std::to_string(info.param.page_size) + (info.param.shuffle_rows ? "_shuffled" : "") +
                                  (info.param.split ? "_split" : "");
                         });

class CpuSegmentRejectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ScenarioOptions o;
    o.page_size = 16;
    o.seed = 11;
    o.shuffle_rows = false;
    s_ = MakeScenario(o);
    s_.BuildSegments();
    ASSERT_GE(s_.segment_request.size(), 2u);
  }
  void ExpectRejected(const std::string& needle) {
    const absl::Status st = ValidateRowPlacement(s_.SegmentHostParams());
    EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
    EXPECT_NE(std::string(st.message()).find(needle), std::string::npos) << "message: " << st.message();
  }
  PagedScenario s_;
};

TEST_F(CpuSegmentRejectTest, AcceptsTheUnmodifiedSegments) {
  EXPECT_TRUE(ValidateRowPlacement(s_.SegmentHostParams()).ok());
}
TEST_F(CpuSegmentRejectTest, RejectsIndptrNotStartingAtZero) {
  s_.segment_indptr[0] = 1;
  ExpectRejected("segment_indptr[0] is 1");
}
TEST_F(CpuSegmentRejectTest, RejectsDecreasingIndptr) {
  s_.segment_indptr[2] = s_.segment_indptr[1] - 1;  // segment 1 ends before it begins
  ExpectRejected("not non-decreasing");
}
TEST_F(CpuSegmentRejectTest, RejectsSegmentsNotCoveringEveryRow) {
  s_.segment_indptr.back() -= 1;
  ExpectRejected("must cover every row");
}
TEST_F(CpuSegmentRejectTest, RejectsRequestOutsideTheBatch) {
  s_.segment_request[1] = static_cast<int32_t>(s_.kv_indptr.size());
  ExpectRejected("segment 1 (rows");
}
TEST_F(CpuSegmentRejectTest, RejectsNegativeStart) {
  s_.segment_start[0] = -1;
  ExpectRejected("start position -1 is negative");
}
TEST_F(CpuSegmentRejectTest, RejectsRunPastTheRequestsPages) {
  const int32_t b = s_.segment_request[0];
  const int32_t owned = s_.kv_indptr[b + 1] - s_.kv_indptr[b];
  s_.segment_start[0] = owned * 16 - 1;  // the run's first row fits, the next ones do not
  ExpectRejected("but the request owns");
}
TEST_F(CpuSegmentRejectTest, RejectsPositionsOverflowingInt32) {
  s_.segment_start[0] = std::numeric_limits<int32_t>::max();
  ExpectRejected("overflow int32");
}
TEST_F(CpuSegmentRejectTest, RejectsPageIdOutsideThePool) {
  // The page holding segment 0's first row.
  s_.kv_indices[s_.kv_indptr[s_.segment_request[0]] + s_.segment_start[0] / 16] = s_.num_pages;
  ExpectRejected("is outside [0, " + std::to_string(s_.num_pages) + ")");
}

// What the kernel's bounds guard relies on: rows outside the segments, or
// placed by a bad segment, have no entry (and no index array is read past its end).
TEST(CpuSegmentEntries, RowsOutsideTheSegmentsHaveNoEntry) {
  ScenarioOptions o;
  o.shuffle_rows = false;
  PagedScenario s = MakeScenario(o);
  s.BuildSegments();
  QuantizeAppendParams p = s.SegmentHostParams();
  EXPECT_EQ(CacheEntryOfRowIndex(p, -1), -1);
  EXPECT_EQ(CacheEntryOfRowIndex(p, s.num_rows), -1);
  for (int64_t i = 0; i < s.num_rows; ++i) {
    ASSERT_EQ(CacheEntryOfRowIndex(p, i), CacheEntryOfRow(p, s.batch_indices[i], s.positions[i])) << "row " << i;
  }
  s.segment_request[0] = -3;
  p = s.SegmentHostParams();
  EXPECT_EQ(CacheEntryOfRowIndex(p, 0), -1);
  p.num_segments = 0;
  EXPECT_FALSE(HasPlacement(p));
}

TEST(CpuEmpty, ZeroRowsIsANoOp) {
  std::vector<uint8_t> cache(256, kPoison), sf(32, kPoison), kc(64, kPoison);
  std::vector<int32_t> indices = {0}, indptr = {0, 1}, last = {0};
  uint16_t dummy = 0;
  const absl::Status st = QuantizeAppendCpu(
      TensorView::Contiguous(&dummy, DType::kBFloat16, {0, 512}), TensorView::Contiguous(&dummy, DType::kBFloat16, {0, 64}),
      TensorView::Contiguous(&dummy, DType::kInt32, {0}), TensorView::Contiguous(&dummy, DType::kInt32, {0}),
      TensorView::Contiguous(cache.data(), DType::kUInt8, {1, 1, 256}),
      TensorView::Contiguous(sf.data(), DType::kFloat8E4M3, {1, 1, 32}),
      TensorView::Contiguous(kc.data(), DType::kFloat8E4M3, {1, 1, 64}),
      TensorView::Contiguous(indices.data(), DType::kInt32, {1}), TensorView::Contiguous(indptr.data(), DType::kInt32, {2}),
      TensorView::Contiguous(last.data(), DType::kInt32, {1}), 1.0, 1.0);
  EXPECT_TRUE(st.ok()) << st;
  for (uint8_t b : cache) EXPECT_EQ(b, kPoison);
}

// The launcher's choice for a layers launch: 8 rows per lookup from 128
// rows a layer (a decode step), 2 from 32, one below; layers' rows always
// dealt by warp.
// (Host code of the CUDA launcher: runs without a GPU.)
TEST(LauncherChoice, ALayersLaunchTakesMoreRowsPerLookupForDecodeSteps) {
  EXPECT_EQ(DefaultQuantizeAppendLayersConfig(1).rows_per_warp, 1);
  EXPECT_EQ(DefaultQuantizeAppendLayersConfig(31).rows_per_warp, 1);
  EXPECT_EQ(DefaultQuantizeAppendLayersConfig(32).rows_per_warp, 2);
  EXPECT_EQ(DefaultQuantizeAppendLayersConfig(127).rows_per_warp, 2);
  EXPECT_EQ(DefaultQuantizeAppendLayersConfig(128).rows_per_warp, 8);
  EXPECT_EQ(DefaultQuantizeAppendLayersConfig(256).rows_per_warp, 8);
  EXPECT_EQ(DefaultQuantizeAppendLayersConfig(1 << 20).rows_per_warp, 16);
  EXPECT_FALSE(DefaultQuantizeAppendLayersConfig(32768).block_ranges);
  // A layer of a chunked-prefill size in a layers launch keeps 8 (the
  // decode rule's floor), not the one-layer launch's 4, and blocks of 8
  // warps, 4 per SM.
  EXPECT_EQ(DefaultQuantizeAppendLayersConfig(16384).rows_per_warp, 8);
  EXPECT_EQ(DefaultQuantizeAppendLayersConfig(16384).warps_per_block, 8);
  EXPECT_EQ(DefaultQuantizeAppendLayersConfig(16384).blocks_per_sm, 4);
}

// The one-layer launch: one row per warp below 16k rows; 4 per lookup from
// 16k to 64k rows (chunked-prefill sizes), as contiguous ranges per block,
// 32 warps per SM (8 blocks of 4 below 32k rows, 4 of 8 above); 16 from
// 64k, ranges below 128k and dealt by warp above.
TEST(LauncherChoice, OneLayerLaunchByRowCount) {
  EXPECT_EQ(DefaultQuantizeAppendConfig(16383).rows_per_warp, 1);
  EXPECT_FALSE(DefaultQuantizeAppendConfig(16383).block_ranges);
  for (int64_t rows : {16384, 32767, 32768, 65535}) {
    const QuantizeAppendConfig c = DefaultQuantizeAppendConfig(rows);
    EXPECT_EQ(c.rows_per_warp, 4) << rows;
    EXPECT_EQ(c.warps_per_block, rows < 32768 ? 4 : 8) << rows;
    EXPECT_EQ(c.blocks_per_sm, rows < 32768 ? 8 : 4) << rows;
    EXPECT_TRUE(c.block_ranges) << rows;
  }
  EXPECT_EQ(DefaultQuantizeAppendConfig(65536).rows_per_warp, 16);
  EXPECT_TRUE(DefaultQuantizeAppendConfig(65536).block_ranges);
  EXPECT_EQ(DefaultQuantizeAppendConfig(1 << 20).rows_per_warp, 16);
  EXPECT_FALSE(DefaultQuantizeAppendConfig(1 << 20).block_ranges);
}

}  // namespace
}  // namespace mlakv
