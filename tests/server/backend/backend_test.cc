// Each backend directly (built twice: MLAKV_BACKEND_TEST_DEVICE "cpu" and
// "cuda:0"; the cuda build carries the gpu label and skips itself without a
// GPU): appended rows land byte-exact where the placement says and nowhere
// else, stored bytes round-trip, a placement outside the pool writes nothing.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "kernels/nvfp4_format.h"
#include "kernels/quantize_rows.h"
#include "server/backend/backend_factory.h"
#include "spdlog/sinks/ringbuffer_sink.h"
#include "spdlog/spdlog.h"
#include "tests/testing/vector_files.h"

#ifdef MLAKV_BACKEND_TEST_CUDA
#include <cuda_runtime.h>
#endif

#ifndef MLAKV_BACKEND_TEST_DEVICE
#define MLAKV_BACKEND_TEST_DEVICE "cpu"
#endif

namespace mlakv::server {
namespace {

using format::kCkvPackedBytes;
using format::kCkvSfBytes;
using format::kKpeBytes;

constexpr CacheBackend::Geometry kGeometry{.num_layers = 2, .num_pages = 6, .page_size = 4};
constexpr float kCkv = 0.25f, kKpe = 0.5f;

class BackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    device_ = *Device::Parse(MLAKV_BACKEND_TEST_DEVICE);
    if (device_.is_cuda() && !testing::HaveCuda()) GTEST_SKIP() << "no CUDA device visible; this test needs one";
    auto backend = CreateCacheBackend(device_, kGeometry);
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = std::move(*backend);
  }

  struct Stored {
    std::vector<uint8_t> ckv, sf, kpe;
  };
  Stored Read(int32_t layer, const std::vector<int64_t>& entries) {
    Stored s;
    s.ckv.resize(entries.size() * kCkvPackedBytes);
    s.sf.resize(entries.size() * kCkvSfBytes);
    s.kpe.resize(entries.size() * kKpeBytes);
    EXPECT_TRUE(backend_->ReadEntries(layer, entries, {s.ckv.data(), s.sf.data(), s.kpe.data()}).ok());
    return s;
  }

  // The entries `placed` of `layer` hold what the format says `want`'s rows
  // (a Rows, below) store.
  template <typename WantRows>
  void ExpectStored(int32_t layer, const std::vector<int64_t>& placed, const WantRows& want) {
    const Stored got = Read(layer, placed);
    EXPECT_EQ(got.ckv, want.expected.ckv_packed) << "layer " << layer;
    EXPECT_EQ(got.sf, want.expected.ckv_sf) << "layer " << layer;
    EXPECT_EQ(got.kpe, want.expected.kpe) << "layer " << layer;
  }

  Device device_ = Device::Cpu();
  std::unique_ptr<CacheBackend> backend_;
};

// `n` random bf16 rows and the bytes the format says they store.
struct Rows {
  std::vector<uint16_t> ckv, kpe;
  QuantizedRows expected;
  explicit Rows(int64_t n, uint32_t seed) : ckv(n * 512), kpe(n * 64) {
    std::mt19937 gen(seed);
    for (uint16_t& v : ckv) v = static_cast<uint16_t>(0x3c00 + gen() % 0x600 + (gen() % 2 ? 0x8000 : 0));
    for (uint16_t& v : kpe) v = static_cast<uint16_t>(0x3c00 + gen() % 0x600);
    expected = *QuantizeRows(TensorView::Contiguous(ckv.data(), DType::kBFloat16, {n, 512}),
                             TensorView::Contiguous(kpe.data(), DType::kBFloat16, {n, 64}), kCkv, kKpe,
                             KernelDevice::kCpu);
  }
};

TEST_F(BackendTest, ReportsItsDeviceAndBytes) {
  EXPECT_EQ(backend_->device(), device_);
  EXPECT_EQ(backend_->cache_bytes(), uint64_t{6} * 4 * format::kEntryBytes * 2);
}

TEST_F(BackendTest, AppendedRowsLandWhereThePlacementSaysAndNowhereElse) {
  const Rows rows(6, 1);
  // Request 0 owns pages {4, 1}: positions 2..7 -> entries 18, 19, 4, 5, 6, 7.
  const std::vector<int32_t> indptr = {0, 2}, indices = {4, 1};
  const AppendSegment seg{.rows = {.ckv = rows.ckv.data(), .kpe = rows.kpe.data()}, .count = 6, .request = 0, .start = 2};
  const LayerAppend la{.layer = 1, .dtype = DType::kBFloat16, .ckv_scale = kCkv, .kpe_scale = kKpe,
                       .segments = {&seg, 1}, .rows = std::nullopt, .kv_indptr = indptr, .kv_indices = indices};
  ASSERT_TRUE(backend_->Append({&la, 1}).ok());
  const std::vector<int64_t> placed = {18, 19, 4, 5, 6, 7};
  const Stored got = Read(1, placed);
  EXPECT_EQ(got.ckv, rows.expected.ckv_packed);
  EXPECT_EQ(got.sf, rows.expected.ckv_sf);
  EXPECT_EQ(got.kpe, rows.expected.kpe);
  // Every other entry of both layers is still zero.
  std::vector<int64_t> others;
  for (int64_t e = 0; e < 24; ++e) {
    if (std::find(placed.begin(), placed.end(), e) == placed.end()) others.push_back(e);
  }
  for (int32_t layer : {0, 1}) {
    const Stored rest = Read(layer, layer == 1 ? others : std::vector<int64_t>(placed));
    for (uint8_t b : rest.ckv) ASSERT_EQ(b, 0);
    for (uint8_t b : rest.kpe) ASSERT_EQ(b, 0);
  }
}

// At debug level the CUDA backend times each append with events on its
// stream and logs the split (docs/server.md "Running"): the same bytes land,
// and the line names the call's shape and every phase. The cpu backend
// logs nothing of its own.
TEST_F(BackendTest, AtDebugLevelAnAppendStoresTheSameBytesAndLogsItsSplit) {
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(16);
  const std::shared_ptr<spdlog::logger> before = spdlog::default_logger();
  const spdlog::level::level_enum level = before->level();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("backend_test", sink));
  spdlog::set_level(spdlog::level::debug);
  const Rows rows(6, 11);
  const std::vector<int32_t> indptr = {0, 2}, indices = {4, 1};
  const AppendSegment seg{.rows = {.ckv = rows.ckv.data(), .kpe = rows.kpe.data()}, .count = 6, .request = 0, .start = 2};
  const LayerAppend la{.layer = 1, .dtype = DType::kBFloat16, .ckv_scale = kCkv, .kpe_scale = kKpe,
                       .segments = {&seg, 1}, .rows = std::nullopt, .kv_indptr = indptr, .kv_indices = indices};
  const absl::Status appended = backend_->Append({&la, 1});
  spdlog::set_default_logger(before);
  spdlog::set_level(level);
  ASSERT_TRUE(appended.ok()) << appended;
  ExpectStored(1, {18, 19, 4, 5, 6, 7}, rows);
  const std::vector<std::string> lines = sink->last_formatted();
  if (!device_.is_cuda()) {
    EXPECT_TRUE(lines.empty()) << lines.front();
    return;
  }
  ASSERT_EQ(lines.size(), 1u);
  for (const char* part : {"cuda backend append: layers=1 rows=6 ", " placement=copied ", " us: stage=", " enqueue=",
                           " sync=", " gpu_to_kernel=", " gpu_kernel="}) {
    EXPECT_NE(lines[0].find(part), std::string::npos) << part << " not in: " << lines[0];
  }
}

#ifdef MLAKV_BACKEND_TEST_CUDA
// A call whose every layer reads its rows in place from device memory, at
// most 64 rows a layer, has the kernel read its placement and page table from
// the mapped pinned buffer instead of a copy (CudaBackend::
// ReadsPlacementInPlace); 65 rows, or one layer of host rows beside device
// rows, copy it. Either way every layer stores the bytes the format says:
// the debug line names the path taken, so neither path passes unexercised.
TEST_F(BackendTest, AFewDeviceRowsHaveTheirPlacementReadInPlaceAndStoreTheSameBytes) {
  auto big = CreateCacheBackend(device_, {.num_layers = 2, .num_pages = 40, .page_size = 4});
  ASSERT_TRUE(big.ok()) << big.status();
  backend_ = std::move(*big);
  // A copy of `rows` in device memory, freed with the test.
  std::vector<void*> allocations;
  absl::Cleanup free_rows = [&] {
    for (void* p : allocations) EXPECT_EQ(cudaFree(p), cudaSuccess);
  };
  auto on_device = [&](const Rows& rows) {
    void* ckv = nullptr;
    void* kpe = nullptr;
    EXPECT_EQ(cudaMalloc(&ckv, rows.ckv.size() * 2), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&kpe, rows.kpe.size() * 2), cudaSuccess);
    allocations.push_back(ckv);
    allocations.push_back(kpe);
    EXPECT_EQ(cudaMemcpy(ckv, rows.ckv.data(), rows.ckv.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(kpe, rows.kpe.data(), rows.kpe.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    return RowSource{.ckv = ckv, .kpe = kpe, .device = device_.ordinal(), .ckv_stride_bytes = 512 * 2,
                     .kpe_stride_bytes = 64 * 2};
  };
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(16);
  const std::shared_ptr<spdlog::logger> before = spdlog::default_logger();
  const spdlog::level::level_enum level = before->level();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("backend_test", sink));
  spdlog::set_level(spdlog::level::debug);
  absl::Cleanup restore_logger = [&] {
    spdlog::set_default_logger(before);
    spdlog::set_level(level);
  };

  struct Case {
    int32_t rows;
    bool layer1_on_host;
    const char* placement;
  };
  int32_t next_page = 0;
  for (const Case& c : {Case{1, false, "in_place"}, Case{64, false, "in_place"}, Case{65, false, "copied"},
                        Case{3, true, "copied"}}) {
    SCOPED_TRACE(::testing::Message() << c.rows << " rows" << (c.layer1_on_host ? ", layer 1 from the host" : ""));
    const Rows layer0(c.rows, static_cast<uint32_t>(100 + c.rows)), layer1(c.rows, static_cast<uint32_t>(200 + c.rows));
    // Request 0 owns the next pages; its positions 0..rows-1.
    const int32_t pages = static_cast<int32_t>((c.rows + 3) / 4);
    std::vector<int32_t> indices;
    std::vector<int64_t> placed;
    for (int32_t p = 0; p < pages; ++p) indices.push_back(next_page + p);
    for (int64_t r = 0; r < c.rows; ++r) placed.push_back(int64_t{next_page} * 4 + r);
    next_page += pages;
    const std::vector<int32_t> indptr = {0, pages};
    const AppendSegment seg{.rows = {}, .count = c.rows, .request = 0, .start = 0};
    const RowSource rows1 = c.layer1_on_host ? RowSource{.ckv = layer1.ckv.data(), .kpe = layer1.kpe.data()}
                                             : on_device(layer1);
    const std::vector<LayerAppend> layers = {
        {.layer = 0, .dtype = DType::kBFloat16, .ckv_scale = kCkv, .kpe_scale = kKpe, .segments = {&seg, 1},
         .rows = on_device(layer0), .kv_indptr = indptr, .kv_indices = indices},
        {.layer = 1, .dtype = DType::kBFloat16, .ckv_scale = kCkv, .kpe_scale = kKpe, .segments = {&seg, 1},
         .rows = rows1, .kv_indptr = indptr, .kv_indices = indices}};
    const absl::Status appended = backend_->Append(layers);
    ASSERT_TRUE(appended.ok()) << appended;
    ExpectStored(0, placed, layer0);
    ExpectStored(1, placed, layer1);
    const std::vector<std::string> lines = sink->last_formatted();
    ASSERT_FALSE(lines.empty());
    EXPECT_NE(lines.back().find(absl::StrCat("layers=2 rows=", c.rows, " ")), std::string::npos) << lines.back();
    EXPECT_NE(lines.back().find(absl::StrCat(" placement=", c.placement, " ")), std::string::npos) << lines.back();
  }
}
#endif  // MLAKV_BACKEND_TEST_CUDA

// AppendBatch's compact form: both layers share one segments span (no rows
// of their own) and each layer's rows lie back to back in `rows`, read in
// segment order.
TEST_F(BackendTest, LayersSharingOnePlacementReadTheirRowsInSegmentOrder) {
  const Rows layer0(5, 2), layer1(5, 3);
  // Request 0 owns page 2, request 1 page 5: request 0's positions 0..2 ->
  // entries 8, 9, 10; request 1's positions 1..2 -> entries 21, 22.
  const std::vector<int32_t> indptr = {0, 1, 2}, indices = {2, 5};
  const std::vector<AppendSegment> segments = {{.rows = {}, .count = 3, .request = 0, .start = 0},
                                               {.rows = {}, .count = 0, .request = 1, .start = 0},
                                               {.rows = {}, .count = 2, .request = 1, .start = 1}};
  const std::vector<LayerAppend> layers = {
      {.layer = 0, .dtype = DType::kBFloat16, .ckv_scale = kCkv, .kpe_scale = kKpe, .segments = segments,
       .rows = RowSource{.ckv = layer0.ckv.data(), .kpe = layer0.kpe.data()}, .kv_indptr = indptr,
       .kv_indices = indices},
      {.layer = 1, .dtype = DType::kBFloat16, .ckv_scale = kCkv, .kpe_scale = kKpe, .segments = segments,
       .rows = RowSource{.ckv = layer1.ckv.data(), .kpe = layer1.kpe.data()}, .kv_indptr = indptr,
       .kv_indices = indices}};
  ASSERT_TRUE(backend_->Append(layers).ok());
  const std::vector<int64_t> placed = {8, 9, 10, 21, 22};
  for (int32_t layer : {0, 1}) {
    const Rows& want = layer == 0 ? layer0 : layer1;
    ExpectStored(layer, placed, want);
    std::vector<int64_t> others;
    for (int64_t e = 0; e < 24; ++e) {
      if (std::find(placed.begin(), placed.end(), e) == placed.end()) others.push_back(e);
    }
    const Stored rest = Read(layer, others);
    for (uint8_t b : rest.sf) ASSERT_EQ(b, 0) << "layer " << layer;
  }
}

// Host rows in pieces (as an Append message's rows lie in the slices gRPC
// received): cut mid-row and mid-element, across both segments, read per
// segment (layer 0) and as the layer's one run (layer 1); the same bytes as
// from one buffer.
TEST_F(BackendTest, RowsInPiecesStoreWhatTheSameRowsInOneBufferStore) {
  const Rows layer0(5, 4), layer1(5, 5);
  auto cut = [](const std::vector<uint16_t>& v, std::vector<size_t> cuts) {
    BytePieces p;
    const char* b = reinterpret_cast<const char*>(v.data());
    size_t at = 0;
    cuts.push_back(v.size() * 2);
    for (size_t c : cuts) {
      p.Add(std::string_view(b + at, c - at));
      at = c;
    }
    return p;
  };
  const BytePieces ckv0 = cut(layer0.ckv, {1, 1000, 1024 * 3 + 5}), kpe0 = cut(layer0.kpe, {127, 129, 300});
  const BytePieces ckv1 = cut(layer1.ckv, {4000}), kpe1 = cut(layer1.kpe, {1, 2, 3, 639});
  const std::vector<int32_t> indptr = {0, 1, 2}, indices = {2, 5};
  const RowSource whole0{.ckv_pieces = &ckv0, .kpe_pieces = &kpe0};
  const std::vector<AppendSegment> segments0 = {
      {.rows = whole0, .count = 3, .request = 0, .start = 0},
      {.rows = whole0.From(3, 2), .count = 2, .request = 1, .start = 1}};
  const std::vector<AppendSegment> segments1 = {{.rows = {}, .count = 3, .request = 0, .start = 0},
                                                {.rows = {}, .count = 2, .request = 1, .start = 1}};
  const std::vector<LayerAppend> layers = {
      {.layer = 0, .dtype = DType::kBFloat16, .ckv_scale = kCkv, .kpe_scale = kKpe, .segments = segments0,
       .rows = std::nullopt, .kv_indptr = indptr, .kv_indices = indices},
      {.layer = 1, .dtype = DType::kBFloat16, .ckv_scale = kCkv, .kpe_scale = kKpe, .segments = segments1,
       .rows = RowSource{.ckv_pieces = &ckv1, .kpe_pieces = &kpe1}, .kv_indptr = indptr, .kv_indices = indices}};
  ASSERT_TRUE(backend_->Append(layers).ok());
  const std::vector<int64_t> placed = {8, 9, 10, 21, 22};
  for (int32_t layer : {0, 1}) {
    const Rows& want = layer == 0 ? layer0 : layer1;
    ExpectStored(layer, placed, want);
  }
}

// A multi-megabyte append (a 4 MB bytes message, two layers): the CUDA
// backend sends its staging buffer to the device in two parts, each part's
// host copies cut out of the message's pieces wherever the cut falls; every
// row of both layers lands where the placement says, as one buffer would.
TEST_F(BackendTest, AMultiMegabyteAppendInPiecesStoresEveryRow) {
  constexpr CacheBackend::Geometry kBig{.num_layers = 2, .num_pages = 640, .page_size = 4};
  auto big = CreateCacheBackend(device_, kBig);
  ASSERT_TRUE(big.ok()) << big.status();
  constexpr int64_t kRows = 2043;  // 2 x 2043 x 1152 bytes = 4.7 MB staged, not a multiple of anything
  const Rows layer0(kRows, 11), layer1(kRows, 12);
  // Pieces of uneven sizes, as a message's slices arrive.
  auto cut = [](const std::vector<uint16_t>& v, uint32_t seed) {
    BytePieces p;
    std::mt19937 gen(seed);
    const char* b = reinterpret_cast<const char*>(v.data());
    for (size_t at = 0, size = v.size() * 2; at < size;) {
      const size_t n = std::min<size_t>(size - at, 1 + gen() % (700 << 10));
      p.Add(std::string_view(b + at, n));
      at += n;
    }
    return p;
  };
  const BytePieces ckv0 = cut(layer0.ckv, 1), kpe0 = cut(layer0.kpe, 2), ckv1 = cut(layer1.ckv, 3),
                   kpe1 = cut(layer1.kpe, 4);
  // One request owning pages 639, 638, ..., 0 (reversed), rows at positions 5 .. 5 + kRows - 1.
  std::vector<int32_t> indices(kBig.num_pages);
  for (int32_t i = 0; i < kBig.num_pages; ++i) indices[i] = kBig.num_pages - 1 - i;
  const std::vector<int32_t> indptr = {0, kBig.num_pages};
  const AppendSegment seg0{.rows = {.ckv_pieces = &ckv0, .kpe_pieces = &kpe0}, .count = kRows, .request = 0, .start = 5};
  const AppendSegment seg1{.rows = {.ckv_pieces = &ckv1, .kpe_pieces = &kpe1}, .count = kRows, .request = 0, .start = 5};
  const std::vector<LayerAppend> layers = {
      {.layer = 0, .dtype = DType::kBFloat16, .ckv_scale = kCkv, .kpe_scale = kKpe, .segments = {&seg0, 1},
       .rows = std::nullopt, .kv_indptr = indptr, .kv_indices = indices},
      {.layer = 1, .dtype = DType::kBFloat16, .ckv_scale = kCkv, .kpe_scale = kKpe, .segments = {&seg1, 1},
       .rows = std::nullopt, .kv_indptr = indptr, .kv_indices = indices}};
  ASSERT_TRUE((*big)->Append(layers).ok());
  std::vector<int64_t> placed;
  for (int64_t pos = 5; pos < 5 + kRows; ++pos) {
    placed.push_back(int64_t{indices[pos / kBig.page_size]} * kBig.page_size + pos % kBig.page_size);
  }
  std::swap(backend_, *big);  // Read() and ExpectStored() read backend_
  ExpectStored(0, placed, layer0);
  ExpectStored(1, placed, layer1);
}

// Host rows at an odd address (one piece of an Append message's slices can
// start anywhere): stored as from an aligned buffer (the cpu kernel loads
// 2-byte elements, so the backend copies such rows first; UBSan checks).
TEST_F(BackendTest, RowsAtAnOddAddressStoreWhatAlignedRowsStore) {
  const Rows rows(3, 6);
  std::vector<char> ckv(rows.ckv.size() * 2 + 1), kpe(rows.kpe.size() * 2 + 1);
  std::memcpy(ckv.data() + 1, rows.ckv.data(), rows.ckv.size() * 2);
  std::memcpy(kpe.data() + 1, rows.kpe.data(), rows.kpe.size() * 2);
  const std::vector<int32_t> indptr = {0, 1}, indices = {4};
  const AppendSegment seg{.rows = {.ckv = ckv.data() + 1, .kpe = kpe.data() + 1}, .count = 3, .request = 0, .start = 0};
  const LayerAppend la{.layer = 1, .dtype = DType::kBFloat16, .ckv_scale = kCkv, .kpe_scale = kKpe,
                       .segments = {&seg, 1}, .rows = std::nullopt, .kv_indptr = indptr, .kv_indices = indices};
  ASSERT_TRUE(backend_->Append({&la, 1}).ok());
  ExpectStored(1, {16, 17, 18}, rows);
}

TEST_F(BackendTest, WrittenEntriesReadBackAsTheyWere) {
  const std::vector<int64_t> entries = {3, 4, 5, 20};
  Stored in;
  in.ckv.resize(entries.size() * kCkvPackedBytes);
  in.sf.resize(entries.size() * kCkvSfBytes);
  in.kpe.resize(entries.size() * kKpeBytes);
  std::mt19937 gen(2);
  for (auto* v : {&in.ckv, &in.sf, &in.kpe}) {
    for (uint8_t& b : *v) b = static_cast<uint8_t>(gen());
  }
  ASSERT_TRUE(backend_->WriteEntries(0, entries, {in.ckv.data(), in.sf.data(), in.kpe.data()}).ok());
  const Stored out = Read(0, entries);
  EXPECT_EQ(out.ckv, in.ckv);
  EXPECT_EQ(out.sf, in.sf);
  EXPECT_EQ(out.kpe, in.kpe);
}

TEST_F(BackendTest, APlacementOutsideThePoolIsRefusedAndWritesNothing) {
  const Rows rows(2, 3);
  const std::vector<int32_t> indptr = {0, 1}, indices = {6};  // page 6 of a 6-page pool
  const AppendSegment seg{.rows = {.ckv = rows.ckv.data(), .kpe = rows.kpe.data()}, .count = 2, .request = 0, .start = 0};
  const LayerAppend la{.layer = 0, .dtype = DType::kBFloat16, .ckv_scale = kCkv, .kpe_scale = kKpe,
                       .segments = {&seg, 1}, .rows = std::nullopt, .kv_indptr = indptr, .kv_indices = indices};
  const absl::Status s = backend_->Append({&la, 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  std::vector<int64_t> all(24);
  for (int64_t e = 0; e < 24; ++e) all[e] = e;
  for (uint8_t b : Read(0, all).ckv) ASSERT_EQ(b, 0);
}

TEST_F(BackendTest, EntriesOutsideTheCacheAreRefused) {
  uint8_t buf[kCkvPackedBytes + kCkvSfBytes + kKpeBytes];
  const std::vector<int64_t> bad = {24};
  EXPECT_EQ(backend_->ReadEntries(0, bad, {buf, buf + kCkvPackedBytes, buf + kCkvPackedBytes + kCkvSfBytes}).code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(backend_->ReadEntries(2, {}, {buf, buf, buf}).code(), absl::StatusCode::kInternal);
}

TEST_F(BackendTest, OnlyDeviceCachesExport) {
  absl::StatusOr<std::vector<CacheBackend::LayerHandles>> handles = backend_->ExportHandles();
  if (device_.is_cuda()) {
    ASSERT_TRUE(handles.ok()) << handles.status();
    ASSERT_EQ(handles->size(), 2u);
    EXPECT_EQ((*handles)[0].ckv.size(), 64u);
  } else {
    EXPECT_EQ(handles.status().code(), absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace mlakv::server
