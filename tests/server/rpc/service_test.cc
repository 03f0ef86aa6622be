// The KvCache service in process (Server::InProcessChannel), on the backend
// named by MLAKV_SERVER_TEST_DEVICE: "cpu" (server_service_test) or "cuda:0"
// (server_service_cuda_test, ctest label gpu, skipped without a GPU). Every
// row of DESIGN.md's error table, atomicity (failed, exhausted and cancelled
// appends leave nothing), truncate/free, AppendBatch for 64 sequences, and
// stored bytes equal to the kernel's (QuantizeRows on the CPU) and to
// ../shared/vectors, byte for byte. Pool invariants are checked after each test.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <tuple>

#include <atomic>
#include <chrono>
#include <thread>

#include "grpc/health/v1/health.grpc.pb.h"
#include "kernels/quantize_rows.h"
#include "absl/strings/match.h"
#include "server/core/pool.h"
#include "server/rpc/server_config.h"
#include "tests/server/rpc/service_fixture.h"
#include "tests/testing/vector_files.h"

#ifndef MLAKV_SERVER_TEST_DEVICE
#define MLAKV_SERVER_TEST_DEVICE "cpu"
#endif
// Distinct ctest names per backend: ServiceTest.* (cpu), CudaServiceTest.* (gpu).
#ifdef MLAKV_SERVER_TEST_CUDA_SUITE
#define ServiceTest CudaServiceTest
#endif

namespace mlakv::server::testing {
namespace {

constexpr char kDevice[] = MLAKV_SERVER_TEST_DEVICE;
constexpr float kCkvScale = 0.0625f;
constexpr float kKpeScale = 0.03125f;

QuantizedRows Expected(const Rows& rows, float ckv_scale, float kpe_scale, int64_t first = 0, int64_t count = -1) {
  if (count < 0) count = rows.n - first;
  Rows part;
  part.dtype = rows.dtype;
  part.n = count;
  part.ckv.assign(rows.ckv.begin() + first * 512, rows.ckv.begin() + (first + count) * 512);
  part.kpe.assign(rows.kpe.begin() + first * 64, rows.kpe.begin() + (first + count) * 64);
  absl::StatusOr<QuantizedRows> q =
      QuantizeRows(part.ckv_view(), part.kpe_view(), ckv_scale, kpe_scale, KernelDevice::kCpu);
  EXPECT_TRUE(q.ok()) << q.status();
  return q.ok() ? *q : QuantizedRows{};
}

class ServiceTest : public ::testing::Test, public ServiceFixture {
 protected:
  void SetUp() override {
    if (std::string(kDevice) != "cpu" && !mlakv::testing::HaveCuda()) GTEST_SKIP() << "no CUDA device visible";
    // 4 layers, 16-token pages, 32 pages = 512 tokens.
    StartServer(kDevice, "name: 'default' num_layers: 4 page_size: 16 num_pages: 32");
  }
  void TearDown() override {
    if (IsSkipped()) return;
    absl::Status inv = pool().CheckInvariants();
    EXPECT_TRUE(inv.ok()) << inv;
    StopServer();
  }

  // Appends rows to `layers` (naming the test scales) and expects OK.
  void MustAppend(const std::string& seq, uint32_t start, const Rows& rows, const std::vector<uint32_t>& layers,
                  int64_t per_message = 1 << 30) {
    grpc::Status s = AppendRows(seq, start, rows, layers, kCkvScale, kKpeScale, per_message);
    ASSERT_TRUE(s.ok()) << Describe(s);
  }
  void ExpectStored(const std::string& seq, uint32_t layer, uint32_t start, const QuantizedRows& expect) {
    Stored got = Read(seq, layer, start, static_cast<uint32_t>(expect.rows));
    ASSERT_TRUE(got.status.ok()) << Describe(got.status);
    EXPECT_EQ(mlakv::testing::DescribeMismatch(expect, got.rows), "") << "layer " << layer;
  }
  // An Append of `m` in a view it may not take: INVALID_ARGUMENT naming each
  // of `views` (what to ask for), and its sequence not created.
  void ExpectViewRefused(const v1::AppendRequest& m, std::initializer_list<const char*> views) {
    const grpc::Status refused = Append({m});
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(refused);
    for (const char* view : views) EXPECT_TRUE(absl::StrContains(refused.error_message(), view)) << Describe(refused);
    v1::Sequence none;
    EXPECT_EQ(GetSequence(m.sequence(), &none).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  // Sequences `name`0, `name`1, ... holding prefix[i] tokens in layers 0 and
  // 1 (none when 0), then one compact AppendBatch (view `view`) of step[i]
  // more rows for each; its response in `out`, expected OK.
  void PrefixThenStep(const std::string& name, const std::vector<uint32_t>& prefix, const std::vector<uint32_t>& step,
                      v1::SequenceView view, int seed, v1::AppendBatchResponse* out) {
    for (size_t i = 0; i < prefix.size(); ++i) {
      if (prefix[i] == 0) continue;
      ASSERT_NO_FATAL_FAILURE(MustAppend(name + std::to_string(i), 0, RandomRows(prefix[i], seed + i), {0, 1}));
    }
    uint32_t total = 0;
    for (uint32_t n : step) total += n;
    const Rows rows = RandomRows(total, seed + 100);
    v1::AppendBatchRequest req;
    req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
    req.set_view(view);
    for (size_t i = 0; i < prefix.size(); ++i) {
      v1::SequenceRows* sr = req.add_sequences();
      sr->set_sequence(name + std::to_string(i));
      sr->set_start(prefix[i]);
      sr->set_row_count(step[i]);
    }
    for (uint32_t l : {0u, 1u}) {
      v1::LayerRows* lr = req.add_batch_layers();
      lr->set_layer(l);
      lr->set_ckv(rows.ckv_bytes());
      lr->set_kpe(rows.kpe_bytes());
    }
    grpc::ClientContext ctx;
    const grpc::Status s = stub().AppendBatch(&ctx, req, out);
    ASSERT_TRUE(s.ok()) << Describe(s);
  }
};

// ---- happy paths ---------------------------------------------------------------

TEST_F(ServiceTest, ListPoolsReportsGeometry) {
  grpc::ClientContext ctx;
  v1::ListPoolsResponse resp;
  ASSERT_TRUE(stub().ListPools(&ctx, v1::ListPoolsRequest(), &resp).ok());
  ASSERT_EQ(resp.pools_size(), 1);
  const v1::Pool& p = resp.pools(0);
  EXPECT_EQ(p.name(), "default");
  EXPECT_EQ(p.device(), kDevice);
  EXPECT_EQ(p.format(), v1::CACHE_FORMAT_NVFP4_MLA);
  EXPECT_EQ(p.num_layers(), 4u);
  EXPECT_EQ(p.page_size(), 16u);
  EXPECT_EQ(p.pages_total(), 32u);
  EXPECT_EQ(p.pages_free(), 32u);
  EXPECT_EQ(p.pages_used(), 0u);
  EXPECT_EQ(p.bytes_per_token_per_layer(), 352u);
  EXPECT_EQ(p.cache_bytes(), 352ull * 16 * 32 * 4);
  EXPECT_EQ(p.ckv_dim(), 512u);
  EXPECT_EQ(p.kpe_dim(), 64u);
  ASSERT_EQ(p.layers_size(), 4);
  EXPECT_FALSE(p.layers(0).set());
}

TEST_F(ServiceTest, AppendThenGetSequence) {
  const Rows rows = RandomRows(40, 1);
  v1::AppendResponse resp;
  grpc::Status s = AppendRows("req-1", 0, rows, {0, 1, 2, 3}, kCkvScale, kKpeScale, 1 << 30, &resp);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(resp.rows_written(), 160u);
  EXPECT_EQ(resp.pages_allocated(), 3u);
  EXPECT_EQ(resp.sequence().length(), 40u);

  v1::Sequence seq;
  ASSERT_TRUE(GetSequence("req-1", &seq).ok());
  EXPECT_EQ(seq.pool(), "default");
  EXPECT_EQ(seq.id(), "req-1");
  EXPECT_EQ(seq.length(), 40u);
  EXPECT_EQ(seq.kv_indices_size(), 3);
  EXPECT_EQ(seq.last_page_len(), 8u);
  EXPECT_EQ(seq.page_size(), 16u);
  EXPECT_EQ(seq.capacity_tokens(), 48u);
  ASSERT_EQ(seq.layer_lengths_size(), 4);
  for (uint32_t len : seq.layer_lengths()) EXPECT_EQ(len, 40u);

  const v1::Pool pool = GetPool();
  EXPECT_EQ(pool.pages_used(), 3u);
  EXPECT_EQ(pool.pages_free(), 29u);
  EXPECT_EQ(pool.sequences(), 1u);
  EXPECT_TRUE(pool.layers(2).set());
  EXPECT_EQ(pool.layers(2).ckv_scale(), kCkvScale);
  EXPECT_EQ(pool.layers(2).kpe_scale(), kKpeScale);
  EXPECT_EQ(pool.layers(2).tokens(), 40u);
}

TEST_F(ServiceTest, StoredBytesMatchTheKernelAcrossPagesAndMessages) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    const std::string id = dtype == DType::kBFloat16 ? "bf16" : "f16";
    const Rows rows = RandomRows(53, dtype == DType::kBFloat16 ? 2 : 3, dtype);
    MustAppend(id, 0, rows, {1, 3}, /*per_message=*/7);  // 7-row messages straddle 16-token pages
    const QuantizedRows expect = Expected(rows, kCkvScale, kKpeScale);
    ExpectStored(id, 1, 0, expect);
    ExpectStored(id, 3, 0, expect);
  }
}

TEST_F(ServiceTest, LayersGrowIndependentlyAndLengthIsTheMinimum) {
  const Rows a = RandomRows(20, 4), b = RandomRows(5, 5);
  MustAppend("s", 0, a, {0});
  MustAppend("s", 0, b, {1});
  v1::Sequence seq;
  ASSERT_TRUE(GetSequence("s", &seq).ok());
  EXPECT_EQ(seq.layer_lengths(0), 20u);
  EXPECT_EQ(seq.layer_lengths(1), 5u);
  EXPECT_EQ(seq.layer_lengths(2), 0u);
  EXPECT_EQ(seq.length(), 0u);
  EXPECT_EQ(seq.last_page_len(), 0u);
  EXPECT_EQ(seq.kv_indices_size(), 2);  // one page table for all layers
  MustAppend("s", 5, RandomRows(15, 6), {1});
  ExpectStored("s", 0, 0, Expected(a, kCkvScale, kKpeScale));
}

TEST_F(ServiceTest, RewriteIsAllowedAndKeepsTheLength) {
  const Rows rows = RandomRows(30, 7);
  MustAppend("s", 0, rows, {0});
  const Rows other = RandomRows(10, 8);
  MustAppend("s", 5, other, {0});  // rewrite positions 5..14
  v1::Sequence seq;
  ASSERT_TRUE(GetSequence("s", &seq).ok());
  EXPECT_EQ(seq.layer_lengths(0), 30u);
  ExpectStored("s", 0, 5, Expected(other, kCkvScale, kKpeScale));
  ExpectStored("s", 0, 15, Expected(rows, kCkvScale, kKpeScale, 15, 15));
  MustAppend("s", 0, rows, {0});  // a retried append is harmless
  ExpectStored("s", 0, 0, Expected(rows, kCkvScale, kKpeScale));
}

TEST_F(ServiceTest, VectorFilesRoundTripByteExact) {
  const std::vector<std::string> files = mlakv::testing::VectorFileNames();
  ASSERT_FALSE(files.empty()) << "no vector files in " << mlakv::testing::VectorsDir();
  ASSERT_LE(files.size(), 4u * 8) << "test pool is too small";
  StopServer();
  StartServer(kDevice, "name: 'default' num_layers: " + std::to_string(files.size()) +
                           " page_size: 16 num_pages: 256");
  for (size_t i = 0; i < files.size(); ++i) {
    mlakv::testing::VectorCase vc = mlakv::testing::LoadVectorCase(files[i]);
    Rows rows;
    rows.dtype = vc.dtype;
    rows.n = vc.rows;
    rows.ckv = vc.ckv;
    rows.kpe = vc.kpe;
    // Each file to its own layer of one sequence, in 3 messages.
    const int64_t per = std::max<int64_t>(1, (vc.rows + 2) / 3);
    grpc::Status s = AppendRows("vectors", 0, rows, {static_cast<uint32_t>(i)}, vc.ckv_scale, vc.kpe_scale, per);
    ASSERT_TRUE(s.ok()) << files[i] << ": " << Describe(s);
  }
  for (size_t i = 0; i < files.size(); ++i) {
    mlakv::testing::VectorCase vc = mlakv::testing::LoadVectorCase(files[i]);
    Stored got = Read("vectors", static_cast<uint32_t>(i), 0, static_cast<uint32_t>(vc.rows));
    ASSERT_TRUE(got.status.ok()) << Describe(got.status);
    EXPECT_EQ(mlakv::testing::DescribeMismatch(vc.expect, got.rows), "") << files[i];
    EXPECT_EQ(got.ckv_scale, vc.ckv_scale);
    EXPECT_EQ(got.kpe_scale, vc.kpe_scale);
  }
}

TEST_F(ServiceTest, DequantizedReadMatchesDequantizeRows) {
  const Rows rows = RandomRows(37, 9);
  MustAppend("s", 0, rows, {2});
  const QuantizedRows q = Expected(rows, kCkvScale, kKpeScale);
  const DequantizedRows d = DequantizeRows(q, kCkvScale, kKpeScale);
  Stored got = Read("s", 2, 0, 37, /*dequantize=*/true, /*tokens_per_message=*/10);
  ASSERT_TRUE(got.status.ok()) << Describe(got.status);
  EXPECT_EQ(got.messages, 4);
  ASSERT_EQ(got.ckv_float.size(), d.ckv.size());
  ASSERT_EQ(got.kpe_float.size(), d.kpe.size());
  EXPECT_EQ(std::memcmp(got.ckv_float.data(), d.ckv.data(), d.ckv.size() * 4), 0);
  EXPECT_EQ(std::memcmp(got.kpe_float.data(), d.kpe.data(), d.kpe.size() * 4), 0);
}

TEST_F(ServiceTest, ReadSequenceChunksByTokensAndDefaultsToAllLayers) {
  const Rows rows = RandomRows(25, 10);
  MustAppend("s", 0, rows, {0, 1, 2, 3});
  v1::ReadSequenceRequest req;
  req.set_sequence("s");
  req.set_tokens_per_message(10);
  grpc::ClientContext ctx;
  auto reader = stub().ReadSequence(&ctx, req);
  v1::ReadSequenceResponse resp;
  std::vector<std::pair<uint32_t, uint32_t>> seen;  // (layer, count)
  while (reader->Read(&resp)) {
    seen.emplace_back(resp.layer(), resp.count());
    EXPECT_EQ(resp.ckv_packed().size(), resp.count() * 256u);
  }
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_EQ(seen.size(), 12u);  // 4 layers x (10 + 10 + 5)
  EXPECT_EQ(seen[2], std::make_pair(0u, 5u));
  EXPECT_EQ(seen[11], std::make_pair(3u, 5u));
}

TEST_F(ServiceTest, ReserveTokensAllocatesUpFront) {
  v1::AppendRequest m = AppendMessage("s", 0, RandomRows(3, 11), 0, 3, {0}, kCkvScale, kKpeScale);
  m.set_reserve_tokens(100);
  v1::AppendResponse resp;
  grpc::Status s = Append({m}, &resp);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(resp.pages_allocated(), 7u);
  EXPECT_EQ(resp.sequence().capacity_tokens(), 112u);
  // Appends inside the reservation allocate nothing more.
  v1::AppendResponse more;
  s = AppendRows("s", 3, RandomRows(90, 12), {0}, kCkvScale, kKpeScale, 1 << 30, &more);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(more.pages_allocated(), 0u);
  EXPECT_EQ(GetPool().pages_used(), 7u);
}

TEST_F(ServiceTest, TruncateCutsLayersAndReleasesPages) {
  const Rows rows = RandomRows(50, 13);
  MustAppend("s", 0, rows, {0, 1});
  EXPECT_EQ(GetPool().pages_used(), 4u);
  grpc::ClientContext ctx;
  v1::TruncateSequenceRequest req;
  req.set_sequence("s");
  req.set_length(17);
  v1::Sequence seq;
  grpc::Status s = stub().TruncateSequence(&ctx, req, &seq);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(seq.length(), 0u);  // layers 2 and 3 hold nothing
  EXPECT_EQ(seq.layer_lengths(0), 17u);
  EXPECT_EQ(seq.layer_lengths(1), 17u);
  EXPECT_EQ(seq.kv_indices_size(), 2);
  EXPECT_EQ(GetPool().pages_used(), 2u);
  EXPECT_EQ(GetPool().layers(0).tokens(), 17u);
  ExpectStored("s", 1, 0, Expected(rows, kCkvScale, kKpeScale, 0, 17));
  // Appending again continues from 17.
  MustAppend("s", 17, RandomRows(20, 14), {0});
  // Beyond the longest layer: OUT_OF_RANGE.
  grpc::ClientContext ctx2;
  req.set_length(1000);
  s = stub().TruncateSequence(&ctx2, req, &seq);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
}

TEST_F(ServiceTest, FreeReleasesEveryPage) {
  MustAppend("a", 0, RandomRows(33, 15), {0, 3});
  MustAppend("b", 0, RandomRows(3, 16), {0});
  grpc::ClientContext ctx;
  v1::FreeSequenceRequest req;
  req.set_sequence("a");
  v1::FreeSequenceResponse resp;
  grpc::Status s = stub().FreeSequence(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(resp.pages_freed(), 3u);
  const v1::Pool pool = GetPool();
  EXPECT_EQ(pool.pages_used(), 1u);
  EXPECT_EQ(pool.sequences(), 1u);
  EXPECT_EQ(pool.layers(0).tokens(), 3u);
  EXPECT_EQ(pool.layers(3).tokens(), 0u);
  v1::Sequence seq;
  EXPECT_EQ(GetSequence("a", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, ListSequencesPaginatesInIdOrder) {
  for (const char* id : {"c", "a", "e", "b", "d"}) MustAppend(id, 0, RandomRows(1, 17), {0, 1, 2, 3});
  std::vector<std::string> ids;
  std::string token;
  int pages = 0;
  do {
    grpc::ClientContext ctx;
    v1::ListSequencesRequest req;
    req.set_page_size(2);
    req.set_page_token(token);
    v1::ListSequencesResponse resp;
    ASSERT_TRUE(stub().ListSequences(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.total(), 5u);
    for (const auto& s : resp.sequences()) {
      ids.push_back(s.id());
      EXPECT_EQ(s.length(), 1u);
      EXPECT_EQ(s.pages(), 1u);
    }
    token = resp.next_page_token();
    ++pages;
  } while (!token.empty() && pages < 10);
  EXPECT_EQ(pages, 3);
  EXPECT_EQ(ids, (std::vector<std::string>{"a", "b", "c", "d", "e"}));
}

TEST_F(ServiceTest, GetPageReportsOwnerAndFill) {
  MustAppend("s", 0, RandomRows(20, 18), {0});
  MustAppend("s", 0, RandomRows(3, 19), {2});
  v1::Sequence seq;
  ASSERT_TRUE(GetSequence("s", &seq).ok());
  grpc::ClientContext ctx;
  v1::GetPageRequest req;
  req.set_page(seq.kv_indices(1));
  v1::Page page;
  ASSERT_TRUE(stub().GetPage(&ctx, req, &page).ok());
  EXPECT_TRUE(page.used());
  EXPECT_EQ(page.sequence(), "s");
  EXPECT_EQ(page.page_index(), 1u);
  EXPECT_EQ(page.first_position(), 16u);
  EXPECT_EQ(page.filled_per_layer(0), 4u);
  EXPECT_EQ(page.filled_per_layer(2), 0u);
  EXPECT_EQ(std::vector<uint32_t>(page.layers_written().begin(), page.layers_written().end()),
            std::vector<uint32_t>{0});
  grpc::ClientContext ctx2;
  req.set_page(32);
  EXPECT_EQ(stub().GetPage(&ctx2, req, &page).error_code(), grpc::StatusCode::OUT_OF_RANGE);
}

TEST_F(ServiceTest, AppendBatchWritesSixtyFourSequencesInOneCall) {
  StopServer();
  StartServer(kDevice, "name: 'default' num_layers: 4 page_size: 16 num_pages: 256");
  std::vector<Rows> prefix, step;
  for (int i = 0; i < 64; ++i) {
    prefix.push_back(RandomRows(i % 20, 100 + i));
    step.push_back(RandomRows(1 + i % 2, 200 + i));
    if (prefix.back().n > 0) MustAppend("seq" + std::to_string(i), 0, prefix.back(), {0, 1});
  }
  v1::AppendBatchRequest req;
  req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  for (int i = 0; i < 64; ++i) {
    v1::SequenceRows* sr = req.add_sequences();
    sr->set_sequence("seq" + std::to_string(i));
    sr->set_start(static_cast<uint32_t>(prefix[i].n));
    sr->set_row_count(static_cast<uint32_t>(step[i].n));
    for (uint32_t l : {0u, 1u}) {
      v1::LayerRows* lr = sr->add_layers();
      lr->set_layer(l);
      lr->set_ckv(step[i].ckv_bytes());
      lr->set_kpe(step[i].kpe_bytes());
      lr->set_ckv_scale(kCkvScale);
      lr->set_kpe_scale(kKpeScale);
    }
  }
  grpc::ClientContext ctx;
  v1::AppendBatchResponse resp;
  grpc::Status s = stub().AppendBatch(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << Describe(s);
  ASSERT_EQ(resp.sequences_size(), 64);
  uint64_t rows = 0;
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(resp.sequences(i).id(), "seq" + std::to_string(i));
    EXPECT_EQ(resp.sequences(i).layer_lengths(0), prefix[i].n + step[i].n);
    EXPECT_EQ(resp.sequences(i).layer_lengths(1), prefix[i].n + step[i].n);
    rows += 2 * step[i].n;
  }
  EXPECT_EQ(resp.rows_written(), rows);
  for (int i : {0, 17, 63}) {
    ExpectStored("seq" + std::to_string(i), 1, static_cast<uint32_t>(prefix[i].n),
                 Expected(step[i], kCkvScale, kKpeScale));
    if (prefix[i].n > 0) ExpectStored("seq" + std::to_string(i), 0, 0, Expected(prefix[i], kCkvScale, kKpeScale));
  }
}

// The compact form (a decode step): each layer's rows of every sequence in
// one batch_layers entry. It stores exactly what the per-sequence form
// stores, sequence by sequence, and layers may be written in any order.
TEST_F(ServiceTest, AppendBatchCompactFormStoresWhatThePerSequenceFormStores) {
  StopServer();
  StartServer(kDevice, "name: 'default' num_layers: 4 page_size: 16 num_pages: 512");
  constexpr int kSequences = 40;
  const std::vector<uint32_t> layers = {3, 0, 1};
  std::vector<int64_t> prefix(kSequences), step(kSequences);
  for (int i = 0; i < kSequences; ++i) {
    prefix[i] = i % 19;
    step[i] = i % 5 == 4 ? 0 : 1 + i % 3;  // some sequences add no row this step
  }
  int64_t total = 0;
  for (int i = 0; i < kSequences; ++i) total += step[i];
  const Rows prefix_rows = RandomRows(18, 300);
  std::vector<Rows> per_layer;  // [layer k] total rows, sequence i's at its offset
  for (size_t k = 0; k < layers.size(); ++k) per_layer.push_back(RandomRows(total, 310 + static_cast<uint32_t>(k)));
  v1::AppendBatchRequest compact, per_sequence;
  for (v1::AppendBatchRequest* r : {&compact, &per_sequence}) r->set_dtype(v1::ROW_DTYPE_BFLOAT16);
  int64_t offset = 0;
  for (int i = 0; i < kSequences; ++i) {
    for (const char* prefix_of : {"c", "p"}) {
      const std::string id = prefix_of + std::to_string(i);
      if (prefix[i] > 0) {
        grpc::Status s = AppendRows(id, 0, RandomRows(prefix[i], 400 + i), {0, 1, 2, 3}, kCkvScale, kKpeScale);
        ASSERT_TRUE(s.ok()) << Describe(s);
      }
    }
    for (v1::AppendBatchRequest* r : {&compact, &per_sequence}) {
      v1::SequenceRows* sr = r->add_sequences();
      sr->set_sequence((r == &compact ? "c" : "p") + std::to_string(i));
      sr->set_start(static_cast<uint32_t>(prefix[i]));
      sr->set_row_count(static_cast<uint32_t>(step[i]));
      sr->set_expect_length(static_cast<uint32_t>(prefix[i]));
    }
    for (size_t k = 0; k < layers.size(); ++k) {
      v1::LayerRows* lr = per_sequence.mutable_sequences(i)->add_layers();
      lr->set_layer(layers[k]);
      lr->set_ckv(per_layer[k].ckv_bytes(offset, step[i]));
      lr->set_kpe(per_layer[k].kpe_bytes(offset, step[i]));
    }
    offset += step[i];
  }
  for (size_t k = 0; k < layers.size(); ++k) {
    v1::LayerRows* lr = compact.add_batch_layers();
    lr->set_layer(layers[k]);
    lr->set_ckv(per_layer[k].ckv_bytes());
    lr->set_kpe(per_layer[k].kpe_bytes());
  }
  for (v1::AppendBatchRequest* r : {&compact, &per_sequence}) {
    grpc::ClientContext ctx;
    v1::AppendBatchResponse resp;
    const grpc::Status s = stub().AppendBatch(&ctx, *r, &resp);
    ASSERT_TRUE(s.ok()) << Describe(s);
    EXPECT_EQ(resp.rows_written(), static_cast<uint64_t>(total) * layers.size());
    ASSERT_EQ(resp.sequences_size(), kSequences);
    for (int i = 0; i < kSequences; ++i) {
      EXPECT_EQ(resp.sequences(i).layer_lengths(3), prefix[i] + step[i]) << i;
      EXPECT_EQ(resp.sequences(i).layer_lengths(2), prefix[i]) << i;  // not written
    }
  }
  for (int i = 0; i < kSequences; ++i) {
    if (prefix[i] + step[i] == 0) continue;
    // The prefixes differ (random per id), so compare the step's positions only.
    for (uint32_t l : layers) {
      Stored c = Read("c" + std::to_string(i), l, static_cast<uint32_t>(prefix[i]), static_cast<uint32_t>(step[i]));
      Stored p = Read("p" + std::to_string(i), l, static_cast<uint32_t>(prefix[i]), static_cast<uint32_t>(step[i]));
      if (step[i] == 0) continue;
      ASSERT_TRUE(c.status.ok() && p.status.ok()) << Describe(c.status) << " / " << Describe(p.status);
      EXPECT_EQ(mlakv::testing::DescribeMismatch(p.rows, c.rows), "") << "sequence " << i << " layer " << l;
    }
  }
}

// A sequence named twice in one AppendBatch (new or existing, in either
// form) is INVALID_ARGUMENT naming it, and nothing of the call is written.
TEST_F(ServiceTest, AppendBatchNamingASequenceTwiceWritesNothing) {
  ASSERT_TRUE(AppendRows("old", 0, RandomRows(2, 600), {0, 1, 2, 3}, kCkvScale, kKpeScale).ok());
  const Rows rows = RandomRows(3, 601);
  for (const bool compact : {false, true}) {
    for (const std::vector<std::string>& ids : std::vector<std::vector<std::string>>{
             {"a", "b", "a"}, {"old", "c", "old"}, {"d", "old", "old"}}) {
      v1::AppendBatchRequest req;
      req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
      for (const std::string& id : ids) {
        v1::SequenceRows* sr = req.add_sequences();
        sr->set_sequence(id);
        sr->set_start(id == "old" ? 2 : 0);
        sr->set_row_count(1);
        if (compact) continue;
        v1::LayerRows* lr = sr->add_layers();
        lr->set_layer(0);
        lr->set_ckv(rows.ckv_bytes(0, 1));
        lr->set_kpe(rows.kpe_bytes(0, 1));
      }
      if (compact) {
        v1::LayerRows* lr = req.add_batch_layers();
        lr->set_layer(0);
        lr->set_ckv(rows.ckv_bytes());
        lr->set_kpe(rows.kpe_bytes());
      }
      grpc::ClientContext ctx;
      v1::AppendBatchResponse resp;
      const grpc::Status s = stub().AppendBatch(&ctx, req, &resp);
      const std::string twice = ids[0] == ids[2] ? ids[0] : ids[1];
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
      EXPECT_TRUE(absl::StrContains(s.error_message(), "sequence '" + twice + "' appears twice")) << Describe(s);
      EXPECT_EQ(resp.sequences_size(), 0);
      for (const std::string& id : ids) {
        v1::Sequence seq;
        const grpc::Status g = GetSequence(id, &seq);
        if (id == "old") {
          ASSERT_TRUE(g.ok()) << Describe(g);
          EXPECT_EQ(seq.length(), 2u);
        } else {
          EXPECT_EQ(g.error_code(), grpc::StatusCode::NOT_FOUND) << id << " " << Describe(g);
        }
      }
    }
  }
  EXPECT_EQ(GetPool().layers(0).tokens(), 2u);
}

// SEQUENCE_VIEW_COMPACT is BASIC without the names: the same numbers, in
// request order, with pool, id and server_id empty; SEQUENCE_VIEW_LENGTHS is
// COMPACT without the page table (kv_indices_offset = the pages held); on
// Append and AppendBatch alike. A view outside the enum is refused naming
// all four.
TEST_F(ServiceTest, TheCompactViewIsTheBasicViewWithoutTheNames) {
  StopServer();
  StartServer(kDevice, "name: 'default' num_layers: 2 page_size: 4 num_pages: 256");
  const std::vector<uint32_t> prefix = {0, 3, 4, 7}, step = {5, 1, 2, 0};  // new pages for some, none for others
  v1::AppendBatchResponse responses[3];
  const v1::SequenceView views[3] = {v1::SEQUENCE_VIEW_BASIC, v1::SEQUENCE_VIEW_COMPACT, v1::SEQUENCE_VIEW_LENGTHS};
  for (int v = 0; v < 3; ++v) {
    ASSERT_NO_FATAL_FAILURE(PrefixThenStep(v == 0 ? "b" : v == 1 ? "c" : "l", prefix, step, views[v], 500, &responses[v]));
  }
  const v1::AppendBatchResponse& basic = responses[0];
  const v1::AppendBatchResponse& compact = responses[1];
  const v1::AppendBatchResponse& lengths = responses[2];
  EXPECT_EQ(lengths.rows_written(), basic.rows_written());
  EXPECT_EQ(lengths.pages_allocated(), basic.pages_allocated());
  ASSERT_EQ(lengths.sequences_size(), static_cast<int>(prefix.size()));
  EXPECT_EQ(compact.rows_written(), basic.rows_written());
  EXPECT_EQ(compact.pages_allocated(), basic.pages_allocated());
  EXPECT_EQ(compact.pages_allocated(), 3u);  // b0: 2 pages, b2: 1
  ASSERT_EQ(basic.sequences_size(), static_cast<int>(prefix.size()));
  ASSERT_EQ(compact.sequences_size(), static_cast<int>(prefix.size()));
  for (size_t i = 0; i < prefix.size(); ++i) {
    const v1::Sequence& b = basic.sequences(static_cast<int>(i));
    const v1::Sequence& c = compact.sequences(static_cast<int>(i));
    EXPECT_EQ(b.id(), "b" + std::to_string(i));
    EXPECT_EQ(b.pool(), "default");
    EXPECT_FALSE(b.server_id().empty());
    EXPECT_EQ(c.id(), "") << i;
    EXPECT_EQ(c.pool(), "") << i;
    EXPECT_EQ(c.server_id(), "") << i;
    EXPECT_EQ(c.length(), prefix[i] + step[i]) << i;
    EXPECT_EQ(c.length(), b.length()) << i;
    EXPECT_EQ(c.last_page_len(), b.last_page_len()) << i;
    EXPECT_EQ(c.capacity_tokens(), b.capacity_tokens()) << i;
    EXPECT_EQ(c.page_size(), 4u) << i;
    EXPECT_EQ(c.kv_indices_offset(), b.kv_indices_offset()) << i;
    EXPECT_EQ(c.layer_lengths_size(), 0) << i;
    // The pages the call allocated: the tail of the sequence's page table.
    v1::Sequence stored;
    ASSERT_TRUE(GetSequence("c" + std::to_string(i), &stored).ok());
    ASSERT_EQ(c.kv_indices_offset() + c.kv_indices_size(), static_cast<uint32_t>(stored.kv_indices_size())) << i;
    ASSERT_EQ(c.kv_indices_size(), b.kv_indices_size()) << i;
    for (int k = 0; k < c.kv_indices_size(); ++k) {
      EXPECT_EQ(c.kv_indices(k), stored.kv_indices(static_cast<int>(c.kv_indices_offset()) + k)) << i << " " << k;
    }
    // LENGTHS: the same numbers, no names, no page ids.
    const v1::Sequence& len = lengths.sequences(static_cast<int>(i));
    EXPECT_EQ(len.id(), "") << i;
    EXPECT_EQ(len.pool(), "") << i;
    EXPECT_EQ(len.server_id(), "") << i;
    EXPECT_EQ(len.length(), c.length()) << i;
    EXPECT_EQ(len.last_page_len(), c.last_page_len()) << i;
    EXPECT_EQ(len.capacity_tokens(), c.capacity_tokens()) << i;
    EXPECT_EQ(len.generation() != 0, true) << i;
    EXPECT_EQ(len.kv_indices_size(), 0) << i;
    EXPECT_EQ(len.layer_lengths_size(), 0) << i;
    EXPECT_EQ(len.kv_indices_offset(), static_cast<uint32_t>(stored.kv_indices_size())) << i;
  }
  // The Append stream: one message, the view in it.
  v1::AppendRequest m = AppendMessage("c9", 0, RandomRows(6, 530), 0, 6, {0, 1}, kCkvScale, kKpeScale);
  m.set_view(v1::SEQUENCE_VIEW_COMPACT);
  v1::AppendResponse resp;
  grpc::Status s = Append({m}, &resp);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(resp.sequence().id(), "");
  EXPECT_EQ(resp.sequence().pool(), "");
  EXPECT_EQ(resp.sequence().server_id(), "");
  EXPECT_EQ(resp.sequence().length(), 6u);
  EXPECT_EQ(resp.sequence().kv_indices_size(), 2);
  EXPECT_EQ(resp.pages_allocated(), 2u);
  // ... and LENGTHS: the same append, no page ids.
  m.set_sequence("l9");
  m.set_view(v1::SEQUENCE_VIEW_LENGTHS);
  s = Append({m}, &resp);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(resp.sequence().id(), "");
  EXPECT_EQ(resp.sequence().length(), 6u);
  EXPECT_EQ(resp.sequence().capacity_tokens(), 8u);
  EXPECT_EQ(resp.sequence().kv_indices_size(), 0);
  EXPECT_EQ(resp.sequence().kv_indices_offset(), 2u);
  EXPECT_EQ(resp.pages_allocated(), 2u);
  // Not a view: refused, nothing written.
  m.set_sequence("c10");
  m.set_view(static_cast<v1::SequenceView>(7));
  ExpectViewRefused(m, {"SEQUENCE_VIEW_COMPACT", "SEQUENCE_VIEW_LENGTHS", "SEQUENCE_VIEW_PACKED"});
}

// SEQUENCE_VIEW_PACKED answers an AppendBatch with no Sequence messages:
// parallel arrays in request order carrying what COMPACT carries for each
// sequence (length, where the new pages start, how many, the generation) and
// the new pages back to back -- the tail of each page table. An Append stream
// refuses it and writes nothing.
TEST_F(ServiceTest, ThePackedViewAnswersEverySequenceInParallelArrays) {
  StopServer();
  StartServer(kDevice, "name: 'default' num_layers: 2 page_size: 4 num_pages: 256");
  const std::vector<uint32_t> prefix = {0, 3, 4, 7, 8}, step = {5, 1, 2, 0, 9};  // new pages for some, none for others
  v1::AppendBatchResponse compact, packed;
  ASSERT_NO_FATAL_FAILURE(PrefixThenStep("c", prefix, step, v1::SEQUENCE_VIEW_COMPACT, 540, &compact));
  ASSERT_NO_FATAL_FAILURE(PrefixThenStep("p", prefix, step, v1::SEQUENCE_VIEW_PACKED, 540, &packed));
  EXPECT_EQ(packed.sequences_size(), 0);
  EXPECT_FALSE(compact.has_packed());
  EXPECT_EQ(packed.rows_written(), compact.rows_written());
  EXPECT_EQ(packed.pages_allocated(), compact.pages_allocated());
  EXPECT_EQ(packed.pages_allocated(), 6u);  // pages of 4: sequence 0 2 new, 2 1, 4 3 (8 -> 17 tokens)
  const v1::PackedSequences& a = packed.packed();
  ASSERT_EQ(a.lengths_size(), static_cast<int>(prefix.size()));
  ASSERT_EQ(a.kv_indices_offsets_size(), static_cast<int>(prefix.size()));
  ASSERT_EQ(a.new_page_counts_size(), static_cast<int>(prefix.size()));
  ASSERT_EQ(a.generations_size(), static_cast<int>(prefix.size()));
  EXPECT_EQ(a.new_pages_size(), 6);
  int next = 0;  // into new_pages
  for (size_t i = 0; i < prefix.size(); ++i) {
    const int k = static_cast<int>(i);
    const v1::Sequence& c = compact.sequences(k);
    EXPECT_EQ(a.lengths(k), prefix[i] + step[i]) << i;
    EXPECT_EQ(a.lengths(k), c.length()) << i;
    EXPECT_EQ(a.kv_indices_offsets(k), c.kv_indices_offset()) << i;
    EXPECT_EQ(a.new_page_counts(k), static_cast<uint32_t>(c.kv_indices_size())) << i;
    v1::Sequence stored;
    ASSERT_TRUE(GetSequence("p" + std::to_string(i), &stored).ok());
    EXPECT_EQ(a.generations(k), stored.generation()) << i;
    EXPECT_NE(a.generations(k), 0u) << i;
    ASSERT_EQ(a.kv_indices_offsets(k) + a.new_page_counts(k), static_cast<uint32_t>(stored.kv_indices_size())) << i;
    for (uint32_t j = 0; j < a.new_page_counts(k); ++j) {
      ASSERT_LT(next, a.new_pages_size());
      EXPECT_EQ(a.new_pages(next++), stored.kv_indices(static_cast<int>(a.kv_indices_offsets(k) + j))) << i << " " << j;
    }
  }
  EXPECT_EQ(next, a.new_pages_size());
  // An Append stream answers one sequence: PACKED is refused, nothing written.
  v1::AppendRequest m = AppendMessage("p9", 0, RandomRows(6, 560), 0, 6, {0, 1}, kCkvScale, kKpeScale);
  m.set_view(v1::SEQUENCE_VIEW_PACKED);
  ExpectViewRefused(m, {"SEQUENCE_VIEW_PACKED", "SEQUENCE_VIEW_COMPACT"});
  EXPECT_TRUE(pool().CheckInvariants().ok());
}

// AppendBatch calls parse into the cleared message of an earlier call and
// build their response in one (cq/message_recycler.h): nothing of a call may
// reach the next. Calls of two shapes in turn, on one connection: a compact
// batch of three new sequences (PACKED view, expect_length 0, block hashes)
// and a per-sequence batch of one row for sequence "s" (BASIC view, no
// expectation). A field left from the other shape would fail the call (a
// stale expect_length of 0 on "s", a compact batch beside per-sequence
// layers) or show in its answer (sequences beside a packed block).
TEST_F(ServiceTest, AnAppendBatchSeesNothingOfTheCallsBeforeIt) {
  StopServer();
  StartServer(kDevice, "name: 'default' num_layers: 2 page_size: 4 num_pages: 256");
  uint32_t s_length = 0;
  for (int call = 0; call < 12; ++call) {
    v1::AppendBatchRequest req;
    req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
    v1::AppendBatchResponse resp;
    const Rows rows = RandomRows(call % 2 == 0 ? 3 : 1, 700 + call);
    if (call % 2 == 0) {
      req.set_view(v1::SEQUENCE_VIEW_PACKED);
      for (const char* name : {"a", "b", "c"}) {
        v1::SequenceRows* sr = req.add_sequences();
        sr->set_sequence(absl::StrCat("call", call, name));
        sr->set_row_count(1);
        sr->set_expect_length(0);
        sr->add_block_hashes(std::string(32, static_cast<char>('A' + call)));
      }
      for (uint32_t l : {0u, 1u}) {
        v1::LayerRows* lr = req.add_batch_layers();
        lr->set_layer(l);
        lr->set_ckv(rows.ckv_bytes());
        lr->set_kpe(rows.kpe_bytes());
        lr->set_ckv_scale(kCkvScale);
        lr->set_kpe_scale(kKpeScale);
      }
    } else {
      v1::SequenceRows* sr = req.add_sequences();
      sr->set_sequence("s");
      sr->set_start(s_length);
      sr->set_row_count(1);
      for (uint32_t l : {0u, 1u}) {
        v1::LayerRows* lr = sr->add_layers();
        lr->set_layer(l);
        lr->set_ckv(rows.ckv_bytes());
        lr->set_kpe(rows.kpe_bytes());
        lr->set_ckv_scale(kCkvScale);
        lr->set_kpe_scale(kKpeScale);
      }
    }
    grpc::ClientContext ctx;
    const grpc::Status s = stub().AppendBatch(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << "call " << call << ": " << Describe(s);
    if (call % 2 == 0) {
      EXPECT_EQ(resp.sequences_size(), 0) << call;
      ASSERT_TRUE(resp.has_packed()) << call;
      EXPECT_EQ(resp.packed().lengths_size(), 3) << call;
      EXPECT_EQ(resp.rows_written(), 6u) << call;
    } else {
      EXPECT_FALSE(resp.has_packed()) << call;
      ASSERT_EQ(resp.sequences_size(), 1) << call;
      EXPECT_EQ(resp.sequences(0).id(), "s") << call;
      EXPECT_EQ(resp.sequences(0).length(), ++s_length) << call;
      EXPECT_EQ(resp.rows_written(), 2u) << call;
      ExpectStored("s", 1, s_length - 1, Expected(rows, kCkvScale, kKpeScale));
    }
  }
  for (const char* id : {"call0a", "call10c", "s"}) {
    v1::Sequence stored;
    ASSERT_TRUE(GetSequence(id, &stored).ok()) << id;
    EXPECT_EQ(stored.length(), std::string(id) == "s" ? 6u : 1u) << id;
  }
}

// Every malformed compact batch is refused before anything is written, with
// a message that says what to send instead.
TEST_F(ServiceTest, AppendBatchCompactFormErrorsWriteNothing) {
  MustAppend("a", 0, RandomRows(3, 61), {0, 1});
  const QuantizedRows before = Read("a", 0, 0, 3).rows;
  const uint32_t pages_before = GetPool().pages_used();
  const Rows rows = RandomRows(3, 62);  // "a" 1 row + "b" 2 rows
  auto request = [&] {
    v1::AppendBatchRequest req;
    req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
    for (const auto& [id, start, count] : {std::tuple<const char*, uint32_t, uint32_t>{"a", 3, 1}, {"b", 0, 2}}) {
      v1::SequenceRows* sr = req.add_sequences();
      sr->set_sequence(id);
      sr->set_start(start);
      sr->set_row_count(count);
    }
    for (uint32_t l : {0u, 1u}) {
      v1::LayerRows* lr = req.add_batch_layers();
      lr->set_layer(l);
      lr->set_ckv(rows.ckv_bytes());
      lr->set_kpe(rows.kpe_bytes());
    }
    return req;
  };
  struct Case {
    const char* what;
    std::function<void(v1::AppendBatchRequest&)> change;
    grpc::StatusCode code;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"one row short in a layer", [&](v1::AppendBatchRequest& r) { r.mutable_batch_layers(1)->set_ckv(rows.ckv_bytes(0, 2)); },
       grpc::StatusCode::INVALID_ARGUMENT, "batch_layers[1] (layer 1): holds 2048 ckv"},
      {"a sequence with its own layers", [&](v1::AppendBatchRequest& r) {
         v1::LayerRows* lr = r.mutable_sequences(1)->add_layers();
         lr->set_layer(2);
       }, grpc::StatusCode::INVALID_ARGUMENT, "send every sequence's rows one way"},
      {"more entries than layers", [&](v1::AppendBatchRequest& r) {
         for (int i = 0; i < 3; ++i) *r.add_batch_layers() = r.batch_layers(0);
       }, grpc::StatusCode::INVALID_ARGUMENT, "5 batch_layers entries but pool 'default' has 4 layers"},
      {"a layer twice", [&](v1::AppendBatchRequest& r) { r.mutable_batch_layers(1)->set_layer(0); },
       grpc::StatusCode::INVALID_ARGUMENT, "layer 0 appears twice"},
      {"a layer outside the pool", [&](v1::AppendBatchRequest& r) { r.mutable_batch_layers(1)->set_layer(9); },
       grpc::StatusCode::OUT_OF_RANGE, "layer 9 is outside"},
      {"a stale expect_length", [&](v1::AppendBatchRequest& r) { r.mutable_sequences(0)->set_expect_length(2); },
       grpc::StatusCode::FAILED_PRECONDITION, "'a'"},
      {"a position past the end", [&](v1::AppendBatchRequest& r) { r.mutable_sequences(1)->set_start(1); },
       grpc::StatusCode::OUT_OF_RANGE, "'b'"},
      {"a region without --allow_ipc", [&](v1::AppendBatchRequest& r) {
         r.mutable_batch_layers(0)->clear_ckv();
         r.mutable_batch_layers(0)->mutable_ckv_ref()->set_region("r");
       }, grpc::StatusCode::PERMISSION_DENIED, "allow_ipc"},
  };
  for (const Case& c : cases) {
    v1::AppendBatchRequest req = request();
    c.change(req);
    grpc::ClientContext ctx;
    v1::AppendBatchResponse resp;
    const grpc::Status s = stub().AppendBatch(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), c.code) << c.what << ": " << Describe(s);
    EXPECT_NE(s.error_message().find(c.says), std::string::npos) << c.what << ": " << s.error_message();
    EXPECT_EQ(GetPool().pages_used(), pages_before) << c.what;
    v1::Sequence seq;
    EXPECT_EQ(GetSequence("b", &seq).error_code(), grpc::StatusCode::NOT_FOUND) << c.what;
    ASSERT_TRUE(GetSequence("a", &seq).ok());
    EXPECT_EQ(seq.layer_lengths(0), 3u) << c.what;
    EXPECT_EQ(seq.layer_lengths(1), 3u) << c.what;
  }
  EXPECT_EQ(mlakv::testing::DescribeMismatch(before, Read("a", 0, 0, 3).rows), "");
  // And the unchanged request goes through.
  grpc::ClientContext ctx;
  v1::AppendBatchResponse resp;
  const grpc::Status s = stub().AppendBatch(&ctx, request(), &resp);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(resp.rows_written(), 6u);
}

TEST_F(ServiceTest, HealthServesUntilShutdown) {
  auto health = grpc::health::v1::Health::NewStub(server().InProcessChannel());
  for (const char* service : {"", "mlakv.v1.KvCache"}) {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    const grpc::Status s = health->Check(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << "'" << service << "': " << Describe(s);
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING) << "'" << service << "'";
  }
}

// ---- the error table --------------------------------------------------------------

TEST_F(ServiceTest, WrongCkvByteCountIsInvalidArgument) {
  v1::AppendRequest m = AppendMessage("s", 0, RandomRows(4, 20), 0, 4, {0}, kCkvScale, kKpeScale);
  m.mutable_layers(0)->mutable_ckv()->resize(4000);
  grpc::Status s = Append({m});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  EXPECT_NE(s.error_message().find("ckv bytes 4000 is not rows(4) x 1024 for bf16"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(GetPool().pages_used(), 0u);
}

TEST_F(ServiceTest, WrongKpeByteCountIsInvalidArgument) {
  v1::AppendRequest m = AppendMessage("s", 0, RandomRows(4, 21, DType::kFloat16), 0, 4, {0}, kCkvScale, kKpeScale);
  m.mutable_layers(0)->mutable_kpe()->resize(100);
  grpc::Status s = Append({m});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  EXPECT_NE(s.error_message().find("kpe bytes 100 is not rows(4) x 128 for fp16"), std::string::npos)
      << s.error_message();
}

TEST_F(ServiceTest, UnsetDtypeIsInvalidArgument) {
  v1::AppendRequest m = AppendMessage("s", 0, RandomRows(2, 22), 0, 2, {0}, kCkvScale, kKpeScale);
  m.set_dtype(v1::ROW_DTYPE_UNSPECIFIED);
  grpc::Status s = Append({m});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  EXPECT_NE(s.error_message().find("dtype is unset"), std::string::npos) << s.error_message();
}

TEST_F(ServiceTest, ScalesThatAreNotPositiveNormalAreInvalidArgument) {
  const Rows rows = RandomRows(2, 23);
  for (auto [ckv, kpe] : {std::pair<float, float>{1e-40f, 1.0f}, {-1.0f, 1.0f}, {1.0f, INFINITY}, {NAN, 1.0f},
                          {1.0f, 0.0f}}) {
    grpc::Status s = Append({AppendMessage("s", 0, rows, 0, 2, {0}, ckv, kpe)});
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << ckv << " " << kpe << ": " << Describe(s);
    EXPECT_NE(s.error_message().find("positive normal"), std::string::npos) << s.error_message();
  }
  EXPECT_FALSE(GetPool().layers(0).set());
}

TEST_F(ServiceTest, UnknownPoolIsNotFound) {
  v1::AppendRequest m = AppendMessage("s", 0, RandomRows(1, 24), 0, 1, {0}, kCkvScale, kKpeScale);
  m.set_pool("nope");
  grpc::Status s = Append({m});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(s);
  EXPECT_NE(s.error_message().find("pool 'nope' not found"), std::string::npos) << s.error_message();
  grpc::ClientContext ctx;
  v1::GetPoolRequest req;
  req.set_pool("nope");
  v1::Pool pool;
  EXPECT_EQ(stub().GetPool(&ctx, req, &pool).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, UnknownSequenceIsNotFound) {
  v1::Sequence seq;
  EXPECT_EQ(GetSequence("ghost", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
  {
    grpc::ClientContext ctx;
    v1::FreeSequenceRequest req;
    req.set_sequence("ghost");
    v1::FreeSequenceResponse resp;
    EXPECT_EQ(stub().FreeSequence(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    v1::TruncateSequenceRequest req;
    req.set_sequence("ghost");
    EXPECT_EQ(stub().TruncateSequence(&ctx, req, &seq).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  EXPECT_EQ(Read("ghost", 0, 0, 0).status.error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, HoleIsOutOfRange) {
  MustAppend("s", 0, RandomRows(10, 25), {0});
  grpc::Status s = AppendRows("s", 11, RandomRows(2, 26), {0}, kCkvScale, kKpeScale);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  EXPECT_NE(s.error_message().find("hole"), std::string::npos) << s.error_message();
  // Into a fresh layer, a start above 0 is a hole too.
  s = AppendRows("s", 1, RandomRows(2, 27), {1}, kCkvScale, kKpeScale);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  v1::Sequence seq;
  ASSERT_TRUE(GetSequence("s", &seq).ok());
  EXPECT_EQ(seq.layer_lengths(0), 10u);
  EXPECT_EQ(seq.layer_lengths(1), 0u);
}

TEST_F(ServiceTest, LayerOutOfRangeIsOutOfRange) {
  grpc::Status s = AppendRows("s", 0, RandomRows(2, 28), {4}, kCkvScale, kKpeScale);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  EXPECT_NE(s.error_message().find("layer 4 is outside [0, 4)"), std::string::npos) << s.error_message();
  EXPECT_EQ(Read("s", 0, 0, 0).status.error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, ScaleMismatchIsFailedPrecondition) {
  MustAppend("a", 0, RandomRows(3, 29), {0});
  grpc::Status s = AppendRows("b", 0, RandomRows(3, 30), {0}, 0.5f, 0.25f);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
  EXPECT_NE(s.error_message().find("has ckv_scale 0.0625 kpe_scale 0.03125"), std::string::npos) << s.error_message();
  // Leaving the scales unset uses the layer's.
  s = AppendRows("b", 0, RandomRows(3, 31), {0});
  EXPECT_TRUE(s.ok()) << Describe(s);
}

TEST_F(ServiceTest, LayerWithoutScalesRefusesUnscaledRows) {
  grpc::Status s = AppendRows("a", 0, RandomRows(3, 32), {1});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
  EXPECT_NE(s.error_message().find("has no scales yet"), std::string::npos) << s.error_message();
}

TEST_F(ServiceTest, ScalesOfAnEmptiedLayerMayChange) {
  MustAppend("a", 0, RandomRows(3, 33), {0});
  grpc::ClientContext ctx;
  v1::FreeSequenceRequest req;
  req.set_sequence("a");
  v1::FreeSequenceResponse resp;
  ASSERT_TRUE(stub().FreeSequence(&ctx, req, &resp).ok());
  grpc::Status s = AppendRows("b", 0, RandomRows(3, 34), {0}, 0.5f, 0.25f);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(GetPool().layers(0).ckv_scale(), 0.5f);
}

TEST_F(ServiceTest, ConfiguredScalesAreFixed) {
  StopServer();
  StartServer(kDevice, "name: 'default' num_layers: 2 page_size: 16 num_pages: 8 "
                       "layer_scales { layer: 1 ckv_scale: 2 kpe_scale: 4 } all_layers { ckv_scale: 1 kpe_scale: 1 }");
  EXPECT_TRUE(GetPool().layers(0).set());
  EXPECT_EQ(GetPool().layers(1).ckv_scale(), 2.0f);
  grpc::Status s = AppendRows("a", 0, RandomRows(3, 35), {1}, 0.5f, 0.25f);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
  EXPECT_NE(s.error_message().find("fixed by configuration"), std::string::npos) << s.error_message();
  const Rows rows = RandomRows(3, 36);
  s = AppendRows("a", 0, rows, {1});
  ASSERT_TRUE(s.ok()) << Describe(s);
  ExpectStored("a", 1, 0, Expected(rows, 2.0f, 4.0f));
}

TEST_F(ServiceTest, PoolExhaustedWritesNothing) {
  MustAppend("big", 0, RandomRows(500, 37), {0});  // 32 pages of 16 would be 512 tokens: 32 used
  const QuantizedRows before = Read("big", 0, 0, 500).rows;
  EXPECT_EQ(GetPool().pages_free(), 0u);
  grpc::Status s = AppendRows("other", 0, RandomRows(2, 38), {0}, kCkvScale, kKpeScale);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << Describe(s);
  EXPECT_NE(s.error_message().find("nothing was written"), std::string::npos) << s.error_message();
  // A growing append of an existing sequence: same, and it keeps its length.
  s = AppendRows("big", 490, RandomRows(40, 39), {0}, kCkvScale, kKpeScale);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << Describe(s);
  v1::Sequence seq;
  EXPECT_EQ(GetSequence("other", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
  ASSERT_TRUE(GetSequence("big", &seq).ok());
  EXPECT_EQ(seq.layer_lengths(0), 500u);
  EXPECT_EQ(mlakv::testing::DescribeMismatch(before, Read("big", 0, 0, 500).rows), "");
  // More than the whole pool.
  s = AppendRows("huge", 0, RandomRows(513, 40), {1}, kCkvScale, kKpeScale);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << Describe(s);
  EXPECT_FALSE(GetPool().layers(1).set());
}

TEST_F(ServiceTest, DrainingRefusesNewCallsWithUnavailable) {
  MustAppend("s", 0, RandomRows(2, 41), {0});
  server().service().StartDraining();
  v1::Sequence seq;
  EXPECT_EQ(GetSequence("s", &seq).error_code(), grpc::StatusCode::UNAVAILABLE);
  grpc::Status s = AppendRows("s", 2, RandomRows(2, 42), {0});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << Describe(s);
  EXPECT_EQ(Read("s", 0, 0, 2).status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(ServiceTest, SecondAppendToABusySequenceIsAborted) {
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = stub().Append(&ctx, &resp);
  ASSERT_TRUE(writer->Write(AppendMessage("s", 0, RandomRows(5, 43), 0, 5, {0}, kCkvScale, kKpeScale)));
  // Wait until the server has staged it (its pages are allocated).
  for (int i = 0; i < 500 && GetPool().pages_used() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_EQ(GetPool().pages_used(), 1u);
  grpc::Status s = AppendRows("s", 0, RandomRows(1, 44), {0}, kCkvScale, kKpeScale);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << Describe(s);
  writer->WritesDone();
  s = writer->Finish();
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(resp.sequence().layer_lengths(0), 5u);
}

// ---- atomicity ----------------------------------------------------------------------

TEST_F(ServiceTest, FailedStreamLeavesNothing) {
  const Rows rows = RandomRows(40, 45);
  std::vector<v1::AppendRequest> messages = {AppendMessage("s", 0, rows, 0, 20, {0, 1}, kCkvScale, kKpeScale),
                                             AppendMessage("", 20, rows, 20, 20, {0, 1})};
  messages[1].mutable_layers(1)->mutable_kpe()->resize(7);  // second message is malformed
  grpc::Status s = Append(messages);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  EXPECT_NE(s.error_message().find("rolled back"), std::string::npos) << s.error_message();
  v1::Sequence seq;
  EXPECT_EQ(GetSequence("s", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
  const v1::Pool pool = GetPool();
  EXPECT_EQ(pool.pages_used(), 0u);
  EXPECT_EQ(pool.sequences(), 0u);
  EXPECT_FALSE(pool.layers(0).set()) << "scales set by the failed append are unset again";
  EXPECT_EQ(pool.layers(0).tokens(), 0u);
}

// The server reads message k+1 while message k is processed: a failure in the
// middle of a long stream, with valid messages already read behind it, must
// still roll everything back and answer once. Repeated to vary the timing.
TEST_F(ServiceTest, FailureMidStreamWithMessagesReadBehindIt) {
  const Rows rows = RandomRows(40, 49);
  for (int round = 0; round < 20; ++round) {
    std::vector<v1::AppendRequest> messages;
    for (uint32_t m = 0; m < 10; ++m) {
      messages.push_back(m == 0 ? AppendMessage("s", 0, rows, 0, 4, {0, 1}, kCkvScale, kKpeScale)
                                : AppendMessage("", 4 * m, rows, 4 * m, 4, {0, 1}));
    }
    messages[3].mutable_layers(0)->mutable_ckv()->resize(5);  // message 4 of 10 is malformed
    grpc::Status s = Append(messages);
    ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "round " << round << ": " << Describe(s);
    EXPECT_NE(s.error_message().find("message 4 of the stream"), std::string::npos) << s.error_message();
    v1::Sequence seq;
    EXPECT_EQ(GetSequence("s", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(GetPool().pages_used(), 0u) << "round " << round;
  }
}

TEST_F(ServiceTest, LongStreamOfSmallMessagesIsByteExact) {
  const Rows rows = RandomRows(256, 50);
  MustAppend("long", 0, rows, {0, 2}, /*per_message=*/3);  // 86 messages, read ahead of processing
  const QuantizedRows expect = Expected(rows, kCkvScale, kKpeScale);
  ExpectStored("long", 0, 0, expect);
  ExpectStored("long", 2, 0, expect);
}

TEST_F(ServiceTest, FailedStreamRestoresRewrittenRows) {
  const Rows original = RandomRows(40, 46);
  MustAppend("s", 0, original, {0});
  const QuantizedRows before = Read("s", 0, 0, 40).rows;
  const Rows other = RandomRows(50, 47);
  // Rewrites 0..29 and grows to 50 in two messages, then a hole fails it.
  std::vector<v1::AppendRequest> messages = {AppendMessage("s", 0, other, 0, 30, {0}),
                                             AppendMessage("", 30, other, 30, 20, {0}),
                                             AppendMessage("", 60, other, 0, 1, {0})};
  grpc::Status s = Append(messages);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  v1::Sequence seq;
  ASSERT_TRUE(GetSequence("s", &seq).ok());
  EXPECT_EQ(seq.layer_lengths(0), 40u);
  EXPECT_EQ(seq.kv_indices_size(), 3);
  EXPECT_EQ(mlakv::testing::DescribeMismatch(before, Read("s", 0, 0, 40).rows), "");
  EXPECT_EQ(GetPool().pages_used(), 3u);
}

TEST_F(ServiceTest, MultiMessageStreamCommitsAtTheEnd) {
  const Rows rows = RandomRows(40, 48);
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = stub().Append(&ctx, &resp);
  ASSERT_TRUE(writer->Write(AppendMessage("s", 0, rows, 0, 20, {0}, kCkvScale, kKpeScale)));
  for (int i = 0; i < 500 && GetPool().pages_used() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  v1::Sequence seq;
  EXPECT_EQ(GetSequence("s", &seq).error_code(), grpc::StatusCode::NOT_FOUND) << "invisible until commit";
  ASSERT_TRUE(writer->Write(AppendMessage("", 20, rows, 20, 20, {0})));
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(resp.rows_written(), 40u);
  ASSERT_TRUE(GetSequence("s", &seq).ok());
  EXPECT_EQ(seq.layer_lengths(0), 40u);
}

TEST_F(ServiceTest, CancelledStreamLeavesNoPages) {
  MustAppend("keep", 0, RandomRows(10, 49), {0});
  const QuantizedRows before = Read("keep", 0, 0, 10).rows;
  for (const char* id : {"new", "keep"}) {
    grpc::ClientContext ctx;
    v1::AppendResponse resp;
    auto writer = stub().Append(&ctx, &resp);
    const uint32_t start = std::string(id) == "keep" ? 0 : 0;
    const Rows rows = RandomRows(60, 50);
    ASSERT_TRUE(writer->Write(AppendMessage(id, start, rows, 0, 30, {0}, kCkvScale, kKpeScale)));
    ASSERT_TRUE(writer->Write(AppendMessage("", start + 30, rows, 30, 30, {0})));
    // Wait until both messages are staged: 4 pages for 60 tokens (plus "keep"'s 1).
    const uint32_t want = std::string(id) == "keep" ? 4u : 5u;
    for (int i = 0; i < 1000 && GetPool().pages_used() < want; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ASSERT_EQ(GetPool().pages_used(), want);
    ctx.TryCancel();
    grpc::Status s = writer->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << Describe(s);
    for (int i = 0; i < 1000 && GetPool().pages_used() != 1u; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    EXPECT_EQ(GetPool().pages_used(), 1u) << id;
    EXPECT_EQ(GetPool().sequences(), 1u) << id;
  }
  v1::Sequence seq;
  EXPECT_EQ(GetSequence("new", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
  ASSERT_TRUE(GetSequence("keep", &seq).ok());
  EXPECT_EQ(seq.layer_lengths(0), 10u);
  EXPECT_EQ(mlakv::testing::DescribeMismatch(before, Read("keep", 0, 0, 10).rows), "") << "rewrites restored";
}

// gRPC's default SO_REUSEPORT would let a second server bind this port and
// take a share of its connections; here that is an error.
TEST_F(ServiceTest, SecondServerOnAPortInUseIsRefused) {
  StopServer();
  StartServer(kDevice, "name: 'default' num_layers: 2 page_size: 16 num_pages: 8", "", "127.0.0.1:0");
  ASSERT_GT(server().bound_port(), 0);
  KvCacheServer::Options options;
  options.config.add_pools()->set_name("default");
  options.config.mutable_pools(0)->set_num_layers(2);
  options.config.mutable_pools(0)->set_page_size(16);
  options.config.mutable_pools(0)->set_num_pages(8);
  options.listen = server().bound_address();
  options.default_device = kDevice;
  absl::StatusOr<std::unique_ptr<KvCacheServer>> second = KvCacheServer::Create(options);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_THAT(std::string(second.status().message()), ::testing::HasSubstr("cannot listen on '" + options.listen));
}

// The PUB socket's queue limit is the config's, refused at start whether or
// not this process publishes (a fleet's config that only fails once someone
// adds --kv_events_endpoint would fail at the worst moment).
TEST_F(ServiceTest, AnEventSendQueuePastItsLimitIsRefusedWithoutAPublisher) {
  KvCacheServer::Options options;
  options.config.add_pools()->set_name("default");
  options.config.mutable_pools(0)->set_num_layers(1);
  options.config.mutable_pools(0)->set_page_size(4);
  options.config.mutable_pools(0)->set_num_pages(4);
  options.default_device = kDevice;
  options.config.mutable_events()->set_zmq_send_queue(kMaxZmqSendQueue + 1);
  absl::StatusOr<std::unique_ptr<KvCacheServer>> refused = KvCacheServer::Create(options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("events.zmq_send_queue 100001 exceeds 100000"));
  options.config.mutable_events()->set_zmq_send_queue(kMaxZmqSendQueue);
  absl::StatusOr<std::unique_ptr<KvCacheServer>> at_limit = KvCacheServer::Create(options);
  EXPECT_TRUE(at_limit.ok()) << at_limit.status();
}

// Over real HTTP/2 on loopback, where a cancel and a half-close reach the
// server through different frames: a cancelled stream must never commit.
TEST_F(ServiceTest, CancelledStreamOverTcpNeverCommits) {
  StopServer();
  StartServer(kDevice, "name: 'default' num_layers: 2 page_size: 16 num_pages: 64", "", "127.0.0.1:0");
  ASSERT_GT(server().bound_port(), 0);
  auto tcp = v1::KvCache::NewStub(grpc::CreateChannel(server().bound_address(), grpc::InsecureChannelCredentials()));
  const Rows rows = RandomRows(40, 60);
  for (int round = 0; round < 20; ++round) {
    const std::string id = "cancel" + std::to_string(round);
    grpc::ClientContext ctx;
    v1::AppendResponse resp;
    auto writer = tcp->Append(&ctx, &resp);
    ASSERT_TRUE(writer->Write(AppendMessage(id, 0, rows, 0, 20, {0, 1}, kCkvScale, kKpeScale)));
    ASSERT_TRUE(writer->Write(AppendMessage("", 20, rows, 20, 20, {0, 1})));
    if (round % 2 == 0) {  // half the rounds cancel once staged, half at once
      for (int i = 0; i < 1000 && GetPool().pages_used() < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ctx.TryCancel();
    grpc::Status s = writer->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << Describe(s);
  }
  // The server may still be processing a message of a cancelled stream; once
  // it is done, nothing of any of them remains (a wrongly committed stream
  // would stay forever).
  for (int i = 0; i < 5000 && (GetPool().pages_used() != 0 || pool().worker().pending() != 0); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(GetPool().pages_used(), 0u);
  EXPECT_EQ(GetPool().sequences(), 0u);
  for (int round = 0; round < 20; ++round) {
    v1::Sequence seq;
    EXPECT_EQ(GetSequence("cancel" + std::to_string(round), &seq).error_code(), grpc::StatusCode::NOT_FOUND)
        << "round " << round;
  }
  // And a normal stream over the same channel still commits.
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = tcp->Append(&ctx, &resp);
  ASSERT_TRUE(writer->Write(AppendMessage("ok", 0, rows, 0, 40, {0, 1}, kCkvScale, kKpeScale)));
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(resp.sequence().length(), 40u);
}

// SIGTERM's path: new calls are refused, an Append in flight may finish and
// commits.
TEST_F(ServiceTest, ShutdownLetsAnInFlightAppendFinish) {
  StopServer();
  StartServer(kDevice, "name: 'default' num_layers: 2 page_size: 16 num_pages: 64", "", "127.0.0.1:0");
  auto tcp = v1::KvCache::NewStub(grpc::CreateChannel(server().bound_address(), grpc::InsecureChannelCredentials()));
  const Rows rows = RandomRows(40, 61);
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = tcp->Append(&ctx, &resp);
  ASSERT_TRUE(writer->Write(AppendMessage("inflight", 0, rows, 0, 20, {0, 1}, kCkvScale, kKpeScale)));
  for (int i = 0; i < 1000 && pool().Snapshot().pages_used < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::thread stopper([this] { server().Shutdown(absl::Seconds(20)); });
  // New calls are refused while the stream is open.
  bool refused = false;
  for (int i = 0; i < 2000 && !refused; ++i) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::Pool p;
    const grpc::Status s = tcp->GetPool(&c, v1::GetPoolRequest(), &p);
    refused = s.error_code() == grpc::StatusCode::UNAVAILABLE;
    if (!refused) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(refused) << "a call made while draining must get UNAVAILABLE";
  ASSERT_TRUE(writer->Write(AppendMessage("", 20, rows, 20, 20, {0, 1})));
  writer->WritesDone();
  const grpc::Status s = writer->Finish();
  stopper.join();
  ASSERT_TRUE(s.ok()) << Describe(s);
  absl::StatusOr<SequenceSnapshot> seq = pool().GetSequence("inflight");
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(seq->length, 40u);
}

// ... and one that outlives the grace period is cancelled and rolled back.
TEST_F(ServiceTest, ShutdownRollsBackAnAppendPastTheGrace) {
  StopServer();
  StartServer(kDevice, "name: 'default' num_layers: 2 page_size: 16 num_pages: 64", "", "127.0.0.1:0");
  auto tcp = v1::KvCache::NewStub(grpc::CreateChannel(server().bound_address(), grpc::InsecureChannelCredentials()));
  const Rows rows = RandomRows(40, 62);
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = tcp->Append(&ctx, &resp);
  ASSERT_TRUE(writer->Write(AppendMessage("stuck", 0, rows, 0, 20, {0, 1}, kCkvScale, kKpeScale)));
  for (int i = 0; i < 1000 && pool().Snapshot().pages_used < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(pool().Snapshot().pages_used, 2);
  server().Shutdown(absl::Milliseconds(300));  // returns once every call is done
  const grpc::Status s = writer->Finish();
  EXPECT_FALSE(s.ok());
  for (int i = 0; i < 1000 && pool().worker().pending() != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(pool().Snapshot().pages_used, 0);
  EXPECT_EQ(pool().GetSequence("stuck").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ServiceTest, AppendBatchIsAtomic) {
  MustAppend("a", 0, RandomRows(5, 51), {0});
  const QuantizedRows before = Read("a", 0, 0, 5).rows;
  const Rows step = RandomRows(1, 52);
  v1::AppendBatchRequest req;
  req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  for (const auto& [id, start] : {std::pair<std::string, uint32_t>{"a", 2}, {"b", 0}, {"c", 3}}) {  // c: a hole
    v1::SequenceRows* sr = req.add_sequences();
    sr->set_sequence(id);
    sr->set_start(start);
    sr->set_row_count(1);
    v1::LayerRows* lr = sr->add_layers();
    lr->set_layer(0);
    lr->set_ckv(step.ckv_bytes());
    lr->set_kpe(step.kpe_bytes());
  }
  grpc::ClientContext ctx;
  v1::AppendBatchResponse resp;
  grpc::Status s = stub().AppendBatch(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  EXPECT_NE(s.error_message().find("sequence 'c'"), std::string::npos) << s.error_message();
  v1::Sequence seq;
  EXPECT_EQ(GetSequence("b", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(GetPool().pages_used(), 1u);
  EXPECT_EQ(mlakv::testing::DescribeMismatch(before, Read("a", 0, 0, 5).rows), "");
  // A sequence named twice is malformed.
  *req.add_sequences() = req.sequences(0);
  grpc::ClientContext ctx2;
  s = stub().AppendBatch(&ctx2, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
}

// ---- concurrency ------------------------------------------------------------------------

TEST_F(ServiceTest, ConcurrentClientsKeepInvariants) {
  StopServer();
  StartServer(kDevice, "name: 'default' num_layers: 2 page_size: 16 num_pages: 512");
  MustAppend("warmup", 0, RandomRows(1, 53), {0, 1});  // sets both layers' scales
  constexpr int kClients = 8, kAppends = 25;
  std::vector<uint32_t> lengths(kClients, 0);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      std::mt19937 gen(1000 + c);
      const std::string id = "client" + std::to_string(c);
      for (int a = 0; a < kAppends; ++a) {
        const int n = std::uniform_int_distribution<int>(1, 40)(gen);
        grpc::Status s = AppendRows(id, lengths[c], RandomRows(n, gen()), {0, 1}, 0, 0, 16);
        if (!s.ok()) {
          ++failures;
          ADD_FAILURE() << Describe(s);
          return;
        }
        lengths[c] += n;
        if (a % 5 == 0) {
          absl::Status inv = pool().CheckInvariants();
          if (!inv.ok()) ADD_FAILURE() << inv;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(failures.load(), 0);
  uint64_t total = 1;
  for (int c = 0; c < kClients; ++c) {
    v1::Sequence seq;
    ASSERT_TRUE(GetSequence("client" + std::to_string(c), &seq).ok());
    EXPECT_EQ(seq.length(), lengths[c]);
    EXPECT_EQ(seq.kv_indices_size(), static_cast<int>((lengths[c] + 15) / 16));
    total += lengths[c];
  }
  EXPECT_EQ(GetPool().layers(1).tokens(), total);
}

// Streams of messages over 256 KiB have their slots freed, their next reads
// started and their Finish made on the service's transport executors while
// the pool's worker stages the next message (AppendReactor::Process). Many
// such streams at once, some failing on the worker, some cancelled by their
// client mid-stream, must still store every committed row exactly, roll the
// others back and leak no page.
TEST_F(ServiceTest, ConcurrentLargeStreamsCommitExactlyAndLeakNothing) {
  StopServer();
  StartServer(kDevice, "name: 'default' num_layers: 2 page_size: 16 num_pages: 2048");
  MustAppend("warmup", 0, RandomRows(1, 53), {0, 1});  // sets both layers' scales
  const uint32_t free_before = GetPool().pages_free();
  constexpr int kClients = 6, kStreams = 4;
  constexpr int64_t kPerMessage = 120;  // x 2 layers x 1152 B = 276 KB a message
  std::vector<Rows> rows;
  for (int c = 0; c < kClients; ++c) rows.push_back(RandomRows(kStreams * 3 * kPerMessage, 7000 + c));
  std::vector<uint32_t> lengths(kClients, 0);
  std::atomic<int> unexpected{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      const std::string id = "large" + std::to_string(c);
      for (int st = 0; st < kStreams; ++st) {
        Rows part;
        part.dtype = rows[c].dtype;
        part.n = 3 * kPerMessage;
        const int64_t first = static_cast<int64_t>(lengths[c]);
        part.ckv.assign(rows[c].ckv.begin() + first * 512, rows[c].ckv.begin() + (first + part.n) * 512);
        part.kpe.assign(rows[c].kpe.begin() + first * 64, rows[c].kpe.begin() + (first + part.n) * 64);
        // Every third client's third stream is cancelled by its client after
        // two of its three messages (while the worker may be staging them,
        // or the transport thread releasing them): nothing of it commits.
        if (c % 3 == 2 && st == 2) {
          grpc::ClientContext ctx;
          v1::AppendResponse resp;
          auto writer = stub().Append(&ctx, &resp);
          bool wrote = writer->Write(AppendMessage(id, lengths[c], part, 0, kPerMessage, {0, 1}));
          wrote = wrote && writer->Write(AppendMessage("", lengths[c] + kPerMessage, part, kPerMessage, kPerMessage, {0, 1}));
          ctx.TryCancel();
          const grpc::Status s = writer->Finish();
          if (s.error_code() != grpc::StatusCode::CANCELLED) {
            ++unexpected;
            ADD_FAILURE() << id << " cancelled stream ended " << Describe(s) << " (writes ok: " << wrote << ")";
          }
          continue;
        }
        // Every other client's second stream starts past the end: refused on
        // the worker at its first message, and the rows stay where they were.
        const bool refused = c % 2 == 1 && st == 1;
        grpc::Status s;
        // A cancelled stream's client hears CANCELLED before the server has
        // rolled it back; until then the next append is ABORTED (retry).
        for (int tries = 0; tries < 1000; ++tries) {
          s = AppendRows(id, lengths[c] + (refused ? 5 : 0), part, {0, 1}, 0, 0, kPerMessage);
          if (s.error_code() != grpc::StatusCode::ABORTED) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        if (refused) {
          if (s.ok()) ++unexpected;
          continue;
        }
        if (!s.ok()) {
          ++unexpected;
          ADD_FAILURE() << id << " stream " << st << ": " << Describe(s);
          return;
        }
        lengths[c] += static_cast<uint32_t>(part.n);
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(unexpected.load(), 0);
  ASSERT_TRUE(pool().CheckInvariants().ok());
  for (int c = 0; c < kClients; ++c) {
    const std::string id = "large" + std::to_string(c);
    v1::Sequence seq;
    ASSERT_TRUE(GetSequence(id, &seq).ok());
    ASSERT_EQ(seq.length(), lengths[c]);
    // The same rows appended alone, in one stream, store the same bytes.
    Rows alone = rows[c];
    alone.n = lengths[c];
    alone.ckv.resize(alone.n * 512);
    alone.kpe.resize(alone.n * 64);
    MustAppend("alone" + std::to_string(c), 0, alone, {0, 1});
    ExpectSameStored(id, "alone" + std::to_string(c), {0, 1}, lengths[c]);
  }
  for (int c = 0; c < kClients; ++c) {
    for (const std::string& id : {"large" + std::to_string(c), "alone" + std::to_string(c)}) {
      grpc::ClientContext ctx;
      v1::FreeSequenceRequest req;
      req.set_sequence(id);
      v1::FreeSequenceResponse resp;
      ASSERT_TRUE(stub().FreeSequence(&ctx, req, &resp).ok()) << id;
    }
  }
  EXPECT_EQ(GetPool().pages_free(), free_before);
}

}  // namespace
}  // namespace mlakv::server::testing
