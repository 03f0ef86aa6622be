// Pool directly (CPU backend): transactions, scale rules, invariants.
#include "server/core/pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <random>

#include "kernels/quantize_rows.h"

namespace mlakv::server {
namespace {

constexpr float kCkv = 0.125f, kKpe = 0.5f;

Pool::Options CpuOptions(int32_t layers, int32_t page_size, int32_t pages) {
  Pool::Options o;
  o.name = "p";
  o.device = Device::Cpu();
  o.num_layers = layers;
  o.page_size = page_size;
  o.num_pages = pages;
  return o;
}

std::unique_ptr<Pool> MakePool(int32_t layers = 2, int32_t page_size = 4, int32_t pages = 8) {
  auto pool = Pool::Create(CpuOptions(layers, page_size, pages));
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(*pool) : nullptr;
}

struct RowBytes {
  std::string ckv, kpe;
  explicit RowBytes(uint32_t n, uint32_t seed) : ckv(n * 1024, '\0'), kpe(n * 128, '\0') {
    std::mt19937 gen(seed);
    for (size_t i = 0; i < ckv.size(); i += 2) ckv[i + 1] = static_cast<char>(0x3c + gen() % 4), ckv[i] = gen();
    for (size_t i = 0; i < kpe.size(); i += 2) kpe[i + 1] = static_cast<char>(0x3c + gen() % 4), kpe[i] = gen();
  }
};

SequenceRowsIn RowsFor(const RowBytes& b, uint32_t start, uint32_t n, std::vector<int64_t> layers, float ckv = kCkv,
                       float kpe = kKpe) {
  SequenceRowsIn r;
  r.start = start;
  r.row_count = n;
  for (int64_t l : layers) r.layers.push_back(LayerRows::FromBytes(static_cast<int32_t>(l), b.ckv, b.kpe, ckv, kpe));
  return r;
}

absl::Status StageOne(Pool& pool, AppendTransaction& txn, const SequenceRowsIn& rows) {
  AppendTransaction* t = &txn;
  const SequenceRowsIn* r = &rows;
  return pool.Stage({&t, 1}, {&r, 1}, DType::kBFloat16);
}

TEST(PoolTest, CommitMakesTheSequenceVisible) {
  auto pool = MakePool();
  auto txn = pool->BeginAppend("s");
  ASSERT_TRUE(txn.ok()) << txn.status();
  RowBytes b(6, 1);
  ASSERT_TRUE(StageOne(*pool, **txn, RowsFor(b, 0, 6, {0, 1})).ok());
  EXPECT_EQ(pool->GetSequence("s").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool->Snapshot().pages_used, 2);
  SequenceSnapshot s = pool->Commit(**txn);
  EXPECT_EQ(s.length, 6u);
  EXPECT_EQ(s.last_page_len, 2u);
  EXPECT_TRUE(pool->GetSequence("s").ok());
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST(PoolTest, SecondTransactionOnABusySequenceIsAborted) {
  auto pool = MakePool();
  auto txn = pool->BeginAppend("s");
  ASSERT_TRUE(txn.ok());
  EXPECT_EQ(pool->BeginAppend("s").status().code(), absl::StatusCode::kAborted);
  pool->Abort(**txn);
  auto again = pool->BeginAppend("s");
  EXPECT_TRUE(again.ok()) << again.status();
  pool->Abort(**again);
}

TEST(PoolTest, FreeAndTruncateRefuseABusySequence) {
  auto pool = MakePool();
  auto first = pool->BeginAppend("s");
  ASSERT_TRUE(first.ok());
  RowBytes b(3, 2);
  ASSERT_TRUE(StageOne(*pool, **first, RowsFor(b, 0, 3, {0, 1})).ok());
  pool->Commit(**first);
  auto txn = pool->BeginAppend("s");
  ASSERT_TRUE(txn.ok());
  EXPECT_EQ(pool->FreeSequence("s").status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(pool->TruncateSequence("s", 1).status().code(), absl::StatusCode::kAborted);
  pool->Abort(**txn);
  EXPECT_TRUE(pool->FreeSequence("s").ok());
  EXPECT_TRUE(pool->CheckInvariants().ok());
}

TEST(PoolTest, AbortReleasesPagesAndUnsetsScalesItSet) {
  auto pool = MakePool();
  auto txn = pool->BeginAppend("s");
  ASSERT_TRUE(txn.ok());
  RowBytes b(9, 3);
  ASSERT_TRUE(StageOne(*pool, **txn, RowsFor(b, 0, 9, {1})).ok());
  EXPECT_TRUE(pool->Snapshot().layers[1].scales_set);
  EXPECT_EQ(pool->Snapshot().pages_used, 3);
  // Another sequence may not name other scales while rows are staged.
  auto other = pool->BeginAppend("t");
  ASSERT_TRUE(other.ok());
  RowBytes c(1, 4);
  EXPECT_EQ(StageOne(*pool, **other, RowsFor(c, 0, 1, {1}, 1.0f, 1.0f)).code(), absl::StatusCode::kFailedPrecondition);
  pool->Abort(**other);
  pool->Abort(**txn);
  const PoolSnapshot snap = pool->Snapshot();
  EXPECT_FALSE(snap.layers[1].scales_set);
  EXPECT_EQ(snap.pages_used, 0);
  EXPECT_EQ(snap.sequences, 0u);
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST(PoolTest, ValidationFailureAllocatesNothing) {
  auto pool = MakePool();
  auto txn = pool->BeginAppend("s");
  ASSERT_TRUE(txn.ok());
  RowBytes b(5, 5);
  SequenceRowsIn rows = RowsFor(b, 0, 5, {0, 1});
  rows.layers[1].kpe_bytes = 10;
  EXPECT_EQ(StageOne(*pool, **txn, rows).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->Snapshot().pages_used, 0);
  EXPECT_FALSE(pool->Snapshot().layers[0].scales_set);
  pool->Abort(**txn);
}

TEST(PoolTest, ReadRowsReturnsWhatWasStagedAndCommitted) {
  auto pool = MakePool(1, 3, 8);
  RowBytes b(7, 6);
  auto txn = pool->BeginAppend("s");
  ASSERT_TRUE(txn.ok());
  ASSERT_TRUE(StageOne(*pool, **txn, RowsFor(b, 0, 7, {0})).ok());
  pool->Commit(**txn);
  std::vector<uint8_t> ckv(7 * 256), sf(7 * 32), kpe(7 * 64);
  LayerSnapshot layer;
  ASSERT_TRUE(pool->ReadRows("s", 0, 0, 7, {ckv.data(), sf.data(), kpe.data()}, &layer).ok());
  EXPECT_EQ(layer.ckv_scale, kCkv);
  // Not all zero: the rows were quantized into the cache.
  EXPECT_NE(std::count(sf.begin(), sf.end(), 0), static_cast<long>(sf.size()));
  EXPECT_EQ(pool->ReadRows("s", 0, 5, 3, {ckv.data(), sf.data(), kpe.data()}, &layer).code(),
            absl::StatusCode::kAborted);
}

TEST(PoolTest, MessageWithoutRowsAllocatesOnlyItsReservation) {
  auto pool = MakePool();
  auto txn = pool->BeginAppend("s");
  ASSERT_TRUE(txn.ok());
  RowBytes none(0, 7);
  SequenceRowsIn rows = RowsFor(none, 20, 0, {0});  // start 20, no rows: no hole, no pages
  rows.reserve_tokens = 5;
  ASSERT_TRUE(StageOne(*pool, **txn, rows).ok());
  EXPECT_EQ((*txn)->pages_allocated(), 2u);
  const SequenceSnapshot s = pool->Commit(**txn);
  EXPECT_EQ(s.capacity_tokens, 8u);
  EXPECT_EQ(s.length, 0u);
  EXPECT_TRUE(pool->Snapshot().layers[0].scales_set) << "named scales are taken even without rows";
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

TEST(PoolTest, FreeIdleFreesOnlySequencesIdleLongerThanTheTtl) {
  Pool::Options options = CpuOptions(1, 4, 8);
  options.idle_ttl = absl::Seconds(60);
  auto created = Pool::Create(options);
  ASSERT_TRUE(created.ok()) << created.status();
  Pool& pool = **created;
  RowBytes b(5, 8);
  for (const char* id : {"old", "busy", "fresh"}) {
    auto txn = pool.BeginAppend(id);
    ASSERT_TRUE(txn.ok());
    ASSERT_TRUE(StageOne(pool, **txn, RowsFor(b, 0, 5, {0})).ok());
    pool.Commit(**txn);
  }
  EXPECT_EQ(pool.FreeIdle(absl::Now()), 0) << "nothing is idle yet";
  auto busy = pool.BeginAppend("busy");  // an append in flight protects it
  ASSERT_TRUE(busy.ok());
  EXPECT_EQ(pool.FreeIdle(absl::Now() + absl::Seconds(61)), 2);  // "old" and "fresh"
  EXPECT_EQ(pool.GetSequence("old").status().code(), absl::StatusCode::kNotFound);
  pool.Abort(**busy);
  EXPECT_TRUE(pool.GetSequence("busy").ok());  // querying it counts as use
  EXPECT_EQ(pool.FreeIdle(absl::Now() + absl::Seconds(30)), 0);
  EXPECT_EQ(pool.FreeIdle(absl::Now() + absl::Seconds(61)), 1);
  EXPECT_EQ(pool.Snapshot().pages_used, 0);
  EXPECT_EQ(pool.Snapshot().layers[0].tokens, 0u);
  EXPECT_TRUE(pool.CheckInvariants().ok()) << pool.CheckInvariants();
}

// Random appends (valid and not: holes, bad layers, wrong byte counts, other
// scales, too many pages), multi-message transactions committed or aborted,
// frees and truncates: after every step free + used == total, every used page
// has one owner, and per-layer token counts add up.
TEST(PoolTest, RandomOperationsKeepInvariants) {
  auto pool = MakePool(/*layers=*/3, /*page_size=*/4, /*pages=*/24);
  std::mt19937 gen(12345);
  const RowBytes rows(12, 9);
  auto pick = [&](int n) { return static_cast<int>(gen() % n); };
  int committed = 0, failed = 0;
  for (int step = 0; step < 1500; ++step) {
    const std::string id = "s" + std::to_string(pick(6));
    const int op = pick(10);
    if (op < 7) {
      auto txn = pool->BeginAppend(id);
      if (!txn.ok()) continue;
      bool ok = true;
      for (int m = 0, messages = 1 + pick(3); m < messages && ok; ++m) {
        const uint32_t n = static_cast<uint32_t>(pick(13));
        const absl::StatusOr<SequenceSnapshot> seq = pool->GetSequence(id);
        const uint32_t len = seq.ok() ? seq->layer_lengths[0] : 0;
        SequenceRowsIn r = RowsFor(rows, static_cast<uint32_t>(pick(static_cast<int>(len) + 3)), n,
                                   {pick(4)},  // layer 3 is out of range
                                   pick(8) == 0 ? 1.0f : kCkv, kKpe);
        r.layers[0].ckv_bytes = n * 1024 - (pick(10) == 0 && n > 0 ? 2 : 0);
        r.layers[0].kpe_bytes = n * 128;
        if (pick(10) == 0) r.reserve_tokens = static_cast<uint32_t>(pick(120));
        ok = StageOne(*pool, **txn, r).ok();
        ASSERT_TRUE(pool->CheckInvariants().ok()) << "step " << step << ": " << pool->CheckInvariants();
      }
      if (ok && pick(4) != 0) {
        pool->Commit(**txn);
        ++committed;
      } else {
        pool->Abort(**txn);
        ++failed;
      }
    } else if (op < 8) {
      (void)pool->FreeSequence(id);
    } else {
      (void)pool->TruncateSequence(id, static_cast<uint32_t>(pick(20)));
    }
    ASSERT_TRUE(pool->CheckInvariants().ok()) << "step " << step << ": " << pool->CheckInvariants();
  }
  EXPECT_GT(committed, 50);
  EXPECT_GT(failed, 50);
  for (int i = 0; i < 6; ++i) (void)pool->FreeSequence("s" + std::to_string(i));
  const PoolSnapshot snap = pool->Snapshot();
  EXPECT_EQ(snap.pages_used, 0);
  EXPECT_EQ(snap.sequences, 0u);
  for (const LayerSnapshot& l : snap.layers) EXPECT_EQ(l.tokens, 0u);
}

// A transaction's staged ends are held once while every message writes every
// layer and per layer after the first message that does not; a commit raises
// a level sequence in one step and any other per layer. Random transactions
// of all-layer and some-layer messages (rewrites, gaps refused, aborts) must
// leave exactly the per-layer lengths of a plain model, and the layers'
// token counts their sum.
TEST(PoolTest, AllLayerAndSomeLayerMessagesCommitTheModelsLengths) {
  constexpr int kLayers = 4;
  auto pool = MakePool(kLayers, /*page_size=*/4, /*pages=*/64);
  std::mt19937 gen(4242);
  auto pick = [&](int n) { return static_cast<int>(gen() % n); };
  std::map<std::string, std::vector<uint32_t>> model;  // id -> committed length per layer
  int level_commits = 0, spread_commits = 0, aborted = 0;
  for (int step = 0; step < 2000; ++step) {
    const std::string id = "s" + std::to_string(pick(5));
    auto txn = pool->BeginAppend(id);
    ASSERT_TRUE(txn.ok()) << txn.status();
    std::vector<uint32_t> lengths = model.count(id) ? model[id] : std::vector<uint32_t>(kLayers, 0);
    std::vector<uint32_t> staged = lengths;
    bool every_message_all_layers = true, ok = true;
    for (int m = 0, messages = 1 + pick(3); m < messages && ok; ++m) {
      std::vector<int64_t> layers;
      if (pick(3) != 0) {
        for (int l = 0; l < kLayers; ++l) layers.push_back(l);
      } else {
        every_message_all_layers = false;
        for (int l = 0; l < kLayers; ++l) {
          if (pick(2) == 0) layers.push_back(l);
        }
        if (layers.empty()) layers.push_back(pick(kLayers));
      }
      const uint32_t shortest = *std::min_element(staged.begin(), staged.end());
      const uint32_t start = static_cast<uint32_t>(pick(static_cast<int>(shortest) + 2));  // may leave a hole
      const uint32_t n = static_cast<uint32_t>(1 + pick(6));
      bool hole = false;
      for (int64_t l : layers) hole = hole || start > staged[l];
      const RowBytes bytes(n, static_cast<uint32_t>(step));
      const absl::Status staged_status = StageOne(*pool, **txn, RowsFor(bytes, start, n, layers));
      ok = staged_status.ok();
      ASSERT_EQ(ok, !hole) << "step " << step << " start " << start << ": " << staged_status;
      if (ok) {
        for (int64_t l : layers) staged[l] = std::max(staged[l], start + n);
      }
    }
    if (ok && pick(5) != 0) {
      const bool level = std::all_of(lengths.begin(), lengths.end(), [&](uint32_t v) { return v == lengths[0]; });
      (every_message_all_layers && level ? level_commits : spread_commits) += 1;
      const SequenceSnapshot snap = pool->Commit(**txn);
      model[id] = staged;
      EXPECT_EQ(snap.length, *std::min_element(staged.begin(), staged.end())) << "step " << step;
    } else {
      pool->Abort(**txn);
      ++aborted;
    }
    ASSERT_TRUE(pool->CheckInvariants().ok()) << "step " << step << ": " << pool->CheckInvariants();
    if (model.count(id)) {
      const absl::StatusOr<SequenceSnapshot> got = pool->GetSequence(id);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->layer_lengths, model[id]) << "step " << step;
    }
    if (pick(40) == 0 && model.count(id)) {  // start the sequence over now and then
      ASSERT_TRUE(pool->FreeSequence(id).ok());
      model.erase(id);
    }
  }
  EXPECT_GT(level_commits, 100);
  EXPECT_GT(spread_commits, 100);
  EXPECT_GT(aborted, 100);
  std::vector<uint64_t> tokens(kLayers, 0);
  for (const auto& [id, lengths] : model) {
    for (int l = 0; l < kLayers; ++l) tokens[l] += lengths[l];
  }
  const PoolSnapshot snap = pool->Snapshot();
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(snap.layers[l].tokens, tokens[l]) << "layer " << l;
}

// A model of what every committed position must hold (which source row, with
// which scales) against random appends, rewrites, aborts (which must restore
// rewritten rows), truncates and frees; the cache is compared byte for byte.
TEST(PoolTest, RandomAppendsAndAbortsStoreExactlyTheCommittedRows) {
  auto pool = MakePool(/*layers=*/2, /*page_size=*/3, /*pages=*/40);
  std::mt19937 gen(777);
  auto pick = [&](int n) { return static_cast<int>(gen() % n); };
  std::vector<RowBytes> sources;
  for (uint32_t i = 0; i < 4; ++i) sources.emplace_back(8, 100 + i);
  struct Cell {
    int source = 0;  // which RowBytes
    int row = 0;     // which row of it
    float ckv = 0, kpe = 0;
  };
  using Layers = std::vector<std::vector<Cell>>;  // [layer][position]
  std::map<std::string, Layers> model;
  auto expected_bytes = [&](const Cell& c) {
    const uint16_t* ckv = reinterpret_cast<const uint16_t*>(sources[c.source].ckv.data()) + c.row * 512;
    const uint16_t* kpe = reinterpret_cast<const uint16_t*>(sources[c.source].kpe.data()) + c.row * 64;
    auto q = QuantizeRows(TensorView::Contiguous(const_cast<uint16_t*>(ckv), DType::kBFloat16, {1, 512}),
                          TensorView::Contiguous(const_cast<uint16_t*>(kpe), DType::kBFloat16, {1, 64}), c.ckv,
                          c.kpe, KernelDevice::kCpu);
    EXPECT_TRUE(q.ok()) << q.status();
    return *q;
  };
  auto verify = [&](int step) {
    for (const auto& [id, layers] : model) {
      for (int32_t l = 0; l < 2; ++l) {
        const uint32_t n = static_cast<uint32_t>(layers[l].size());
        if (n == 0) continue;
        std::vector<uint8_t> ckv(n * 256), sf(n * 32), kpe(n * 64);
        LayerSnapshot st;
        ASSERT_TRUE(pool->ReadRows(id, l, 0, n, {ckv.data(), sf.data(), kpe.data()}, &st).ok()) << step;
        for (uint32_t p = 0; p < n; ++p) {
          const QuantizedRows want = expected_bytes(layers[l][p]);
          ASSERT_EQ(std::memcmp(want.ckv_packed.data(), ckv.data() + p * 256, 256), 0)
              << "step " << step << " " << id << " layer " << l << " pos " << p;
          ASSERT_EQ(std::memcmp(want.ckv_sf.data(), sf.data() + p * 32, 32), 0) << step;
          ASSERT_EQ(std::memcmp(want.kpe.data(), kpe.data() + p * 64, 64), 0) << step;
        }
      }
    }
  };
  int aborted_rewrites = 0;
  for (int step = 0; step < 600; ++step) {
    const std::string id = "s" + std::to_string(pick(4));
    const int op = pick(10);
    if (op < 7) {
      auto txn = pool->BeginAppend(id);
      ASSERT_TRUE(txn.ok());
      Layers staged = model.count(id) ? model[id] : Layers(2);
      bool ok = true, rewrote = false;
      for (int m = 0, messages = 1 + pick(3); m < messages && ok; ++m) {
        const int32_t l = pick(2);
        const int src = pick(4);
        const uint32_t n = 1 + static_cast<uint32_t>(pick(8));
        const uint32_t start = static_cast<uint32_t>(pick(static_cast<int>(staged[l].size()) + 1));
        const bool other_scales = pick(10) == 0;
        const float ckv = other_scales ? 1.0f : kCkv, kpe = other_scales ? 1.0f : kKpe;
        SequenceRowsIn r;
        r.start = start;
        r.row_count = n;
        r.layers.push_back(LayerRows::FromBytes(l, std::string_view(sources[src].ckv).substr(0, n * 1024),
                                                std::string_view(sources[src].kpe).substr(0, n * 128), ckv, kpe));
        ok = StageOne(*pool, **txn, r).ok();
        if (!ok) break;
        const LayerSnapshot st = pool->Snapshot().layers[l];
        if (staged[l].size() < start + n) staged[l].resize(start + n);
        for (uint32_t i = 0; i < n; ++i) staged[l][start + i] = {src, static_cast<int>(i), st.ckv_scale, st.kpe_scale};
        rewrote = rewrote || (model.count(id) && start < model[id][l].size());
      }
      if (ok && pick(3) != 0) {
        pool->Commit(**txn);
        model[id] = staged;
      } else {
        pool->Abort(**txn);
        aborted_rewrites += rewrote ? 1 : 0;
      }
    } else if (op < 8) {
      if (pool->FreeSequence(id).ok()) model.erase(id);
    } else if (model.count(id)) {
      const uint32_t len = static_cast<uint32_t>(pick(12));
      if (pool->TruncateSequence(id, len).ok()) {
        for (auto& layer : model[id]) {
          if (layer.size() > len) layer.resize(len);
        }
      }
    }
    ASSERT_TRUE(pool->CheckInvariants().ok()) << "step " << step << ": " << pool->CheckInvariants();
    if (step % 25 == 0) verify(step);
  }
  verify(600);
  EXPECT_GT(aborted_rewrites, 10) << "the workload should exercise restoring rewritten rows";
}

TEST(PoolTest, RejectsBadOptions) {
  EXPECT_FALSE(Pool::Create(CpuOptions(0, 4, 1)).ok());
  Pool::Options gone = CpuOptions(1, 4, 1);
  gone.device = Device::Cuda(4096);  // no such GPU
  EXPECT_FALSE(Pool::Create(gone).ok());
  EXPECT_FALSE(Pool::Create(CpuOptions(1, 65536, 65536)).ok());
}

}  // namespace
}  // namespace mlakv::server
