// Pool::Stage with shared layers (SequenceRowsIn::shared_layers, the form
// AppendBatch's compact requests take): every sequence of a call reads its
// rows at its own offset of one LayerRows per layer. What it must keep:
//  * the same bytes stored as when each sequence carries its own layers,
//    whether the sequences' rows lie back to back in call order (one
//    placement handed to the backend for all layers) or not (a placement per
//    layer);
//  * the shape checked once for the call, and every error writing nothing.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status_macros.h"
#include "server/backend/forwarding_backend.h"
#include "server/core/atomic_append.h"
#include "server/core/pool.h"
#include "tests/server/core/random_rows.h"
#include "tests/server/core/wrapped_pool.h"

namespace mlakv::server {
namespace {

constexpr float kCkv = 0.25f, kKpe = 0.5f;
constexpr int32_t kLayers = 3, kPageSize = 4;

// Forwards to the cpu backend and records how each Append was shaped.
class RecordingBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status Append(std::span<const LayerAppend> layers) override {
    calls.push_back({});
    for (const LayerAppend& la : layers) {
      calls.back().one_placement = calls.back().one_placement && la.rows.has_value() &&
                                   la.segments.data() == layers.front().segments.data();
      calls.back().layers++;
    }
    return inner().Append(layers);
  }

  struct Call {
    bool one_placement = true;  // every layer: `rows` set and the first layer's segments span
    int layers = 0;
  };
  std::vector<Call> calls;
};

using TestPool = testing::WrappedPool<RecordingBackend>;

TestPool MakePool(int32_t pages = 32) {
  Pool::Options o;
  o.name = "p";
  o.num_layers = kLayers;
  o.page_size = kPageSize;
  o.num_pages = pages;
  o.layer_scales.assign(kLayers, Pool::Options::Scales{kCkv, kKpe});
  return testing::MakeWrappedPool<RecordingBackend>(o);
}

// The rows of one call: per layer, the rows of every sequence back to back.
struct Batch {
  std::vector<std::string> ids;
  std::vector<uint32_t> counts;
  std::vector<testing::RowSet> layer_rows;  // [kLayers], sum(counts) rows each
  std::vector<LayerRows> shared;            // [kLayers] over layer_rows
  uint64_t first_of(size_t i) const {
    uint64_t f = 0;
    for (size_t j = 0; j < i; ++j) f += counts[j];
    return f;
  }
};

Batch MakeBatch(std::vector<uint32_t> counts, uint32_t seed) {
  Batch b;
  b.counts = std::move(counts);
  uint32_t total = 0;
  for (size_t i = 0; i < b.counts.size(); ++i) {
    b.ids.push_back("s" + std::to_string(i));
    total += b.counts[i];
  }
  for (int32_t l = 0; l < kLayers; ++l) b.layer_rows.push_back(testing::MakeRows(total, seed + l, kCkv, kKpe));
  for (int32_t l = 0; l < kLayers; ++l) {
    b.shared.push_back(LayerRows::FromBytes(l, b.layer_rows[l].ckv, b.layer_rows[l].kpe));
  }
  return b;
}

// Sequence i's rows as shared layers at its offset (or at `firsts[i]`).
std::vector<SequenceRowsIn> SharedRows(const Batch& b, uint32_t start, std::vector<uint64_t> firsts = {}) {
  std::vector<SequenceRowsIn> rows(b.ids.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    rows[i].start = start;
    rows[i].row_count = b.counts[i];
    rows[i].shared_layers = b.shared;
    rows[i].shared_first = firsts.empty() ? b.first_of(i) : firsts[i];
  }
  return rows;
}

// The same rows, each sequence carrying its own layers (the reference form).
std::vector<SequenceRowsIn> OwnRows(const Batch& b, uint32_t start) {
  std::vector<SequenceRowsIn> rows(b.ids.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    rows[i].start = start;
    rows[i].row_count = b.counts[i];
    const uint64_t f = b.first_of(i);
    for (int32_t l = 0; l < kLayers; ++l) {
      rows[i].layers.push_back(LayerRows::FromBytes(
          l, std::string_view(b.layer_rows[l].ckv).substr(f * 1024, b.counts[i] * 1024),
          std::string_view(b.layer_rows[l].kpe).substr(f * 128, b.counts[i] * 128)));
    }
  }
  return rows;
}

absl::Status Apply(Pool& pool, const std::vector<std::string>& ids, const std::vector<SequenceRowsIn>& rows) {
  AtomicAppend append(&pool);
  for (const std::string& id : ids) MLAKV_RETURN_IF_ERROR(append.Begin(id));
  std::vector<const SequenceRowsIn*> ptrs;
  for (const SequenceRowsIn& r : rows) ptrs.push_back(&r);
  MLAKV_RETURN_IF_ERROR(append.Stage(ptrs, DType::kBFloat16));
  return append.Commit([] { return absl::OkStatus(); }).status();
}

// Every stored entry of sequence `id`, layer by layer, as a byte string.
std::string Stored(Pool& pool, const std::string& id, uint32_t tokens) {
  std::string out;
  for (int32_t l = 0; l < kLayers; ++l) {
    std::vector<uint8_t> ckv(tokens * 256), sf(tokens * 32), kpe(tokens * 64);
    LayerSnapshot layer;
    const absl::Status s = pool.ReadRows(id, l, 0, tokens, {ckv.data(), sf.data(), kpe.data()}, &layer);
    EXPECT_TRUE(s.ok()) << id << " layer " << l << ": " << s;
    for (const auto* v : {&ckv, &sf, &kpe}) out.append(reinterpret_cast<const char*>(v->data()), v->size());
  }
  return out;
}

TEST(PoolSharedLayersTest, StoresWhatPerSequenceLayersStoreWithOnePlacementForAllLayers) {
  // A sequence without rows in the middle, one that starts a page, uneven counts.
  const Batch first = MakeBatch({3, 0, 5, 1, 4}, 11);
  const Batch second = MakeBatch({2, 0, 4, 7, 1}, 21);
  TestPool shared = MakePool(), own = MakePool();
  ASSERT_TRUE(Apply(*shared.pool, first.ids, SharedRows(first, 0)).ok());
  ASSERT_TRUE(Apply(*own.pool, first.ids, OwnRows(first, 0)).ok());
  // A second step at each sequence's end (sequence 1 holds nothing, so it starts at 0).
  std::vector<SequenceRowsIn> next_shared = SharedRows(second, 0), next_own = OwnRows(second, 0);
  for (size_t i = 0; i < first.ids.size(); ++i) next_shared[i].start = next_own[i].start = first.counts[i];
  next_shared[1].start = next_own[1].start = 0;
  ASSERT_TRUE(Apply(*shared.pool, second.ids, next_shared).ok());
  ASSERT_TRUE(Apply(*own.pool, second.ids, next_own).ok());

  ASSERT_EQ(shared.backend->calls.size(), 2u);
  for (const RecordingBackend::Call& c : shared.backend->calls) {
    EXPECT_TRUE(c.one_placement);
    EXPECT_EQ(c.layers, kLayers);
  }
  EXPECT_FALSE(own.backend->calls[0].one_placement);
  for (size_t i = 0; i < first.ids.size(); ++i) {
    const uint32_t tokens = (i == 1 ? 0 : first.counts[i]) + second.counts[i];
    if (tokens == 0) {
      EXPECT_EQ(shared.pool->GetSequence(first.ids[i]).status().code(), absl::StatusCode::kNotFound);
      continue;
    }
    ASSERT_EQ(shared.pool->GetSequence(first.ids[i])->length, tokens);
    EXPECT_EQ(Stored(*shared.pool, first.ids[i], tokens), Stored(*own.pool, first.ids[i], tokens)) << first.ids[i];
  }
  // And against the CPU reference for the first step's rows of layer 2, sequence 2.
  std::vector<uint8_t> ckv(5 * 256), sf(5 * 32), kpe(5 * 64);
  LayerSnapshot layer;
  ASSERT_TRUE(shared.pool->ReadRows("s2", 2, 0, 5, {ckv.data(), sf.data(), kpe.data()}, &layer).ok());
  for (uint32_t r = 0; r < 5; ++r) {
    const testing::Entry& want = first.layer_rows[2].expected[first.first_of(2) + r];
    EXPECT_EQ(std::memcmp(ckv.data() + r * 256, want.data(), 256), 0) << "row " << r;
    EXPECT_EQ(std::memcmp(sf.data() + r * 32, want.data() + 256, 32), 0) << "row " << r;
    EXPECT_EQ(std::memcmp(kpe.data() + r * 64, want.data() + 288, 64), 0) << "row " << r;
  }
  EXPECT_TRUE(shared.pool->CheckInvariants().ok()) << shared.pool->CheckInvariants();
}

TEST(PoolSharedLayersTest, OffsetsOutOfCallOrderStillStoreEachSequencesOwnRows) {
  // Sequence 0 reads the last rows, sequence 2 the first: no single run, so
  // the pool hands the backend a placement per layer.
  const Batch b = MakeBatch({2, 3, 4}, 31);
  TestPool shared = MakePool(), own = MakePool();
  std::vector<SequenceRowsIn> rows = SharedRows(b, 0, {7, 4, 0});
  ASSERT_TRUE(Apply(*shared.pool, b.ids, rows).ok());
  ASSERT_EQ(shared.backend->calls.size(), 1u);
  EXPECT_FALSE(shared.backend->calls[0].one_placement);
  // The reference: sequence i's own rows from the same offsets.
  std::vector<SequenceRowsIn> ref(3);
  const std::vector<uint64_t> firsts = {7, 4, 0};
  for (size_t i = 0; i < 3; ++i) {
    ref[i].row_count = b.counts[i];
    for (int32_t l = 0; l < kLayers; ++l) {
      ref[i].layers.push_back(LayerRows::FromBytes(
          l, std::string_view(b.layer_rows[l].ckv).substr(firsts[i] * 1024, b.counts[i] * 1024),
          std::string_view(b.layer_rows[l].kpe).substr(firsts[i] * 128, b.counts[i] * 128)));
    }
  }
  ASSERT_TRUE(Apply(*own.pool, b.ids, ref).ok());
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(Stored(*shared.pool, b.ids[i], b.counts[i]), Stored(*own.pool, b.ids[i], b.counts[i])) << b.ids[i];
  }
}

TEST(PoolSharedLayersTest, ARunThatStartsPastTheLayersFirstRowsIsStillOnePlacement) {
  // The layers hold rows for s0, s1, s2, but the call writes only s1 and s2:
  // their run starts at row 3 of every layer.
  const Batch b = MakeBatch({3, 2, 4}, 71);
  TestPool shared = MakePool(), own = MakePool();
  std::vector<SequenceRowsIn> all = SharedRows(b, 0), all_own = OwnRows(b, 0);
  const std::vector<std::string> ids = {b.ids[1], b.ids[2]};
  ASSERT_TRUE(Apply(*shared.pool, ids, {all[1], all[2]}).ok());
  ASSERT_TRUE(Apply(*own.pool, ids, {all_own[1], all_own[2]}).ok());
  ASSERT_EQ(shared.backend->calls.size(), 1u);
  EXPECT_TRUE(shared.backend->calls[0].one_placement);
  for (size_t i : {1, 2}) {
    EXPECT_EQ(Stored(*shared.pool, b.ids[i], b.counts[i]), Stored(*own.pool, b.ids[i], b.counts[i])) << b.ids[i];
  }
}

TEST(PoolSharedLayersTest, BadSharedLayersAreRefusedAndWriteNothing) {
  const Batch b = MakeBatch({2, 3}, 41);
  struct Case {
    const char* what;
    std::function<void(std::vector<SequenceRowsIn>&, std::vector<LayerRows>&)> spoil;
    absl::StatusCode code;
  };
  const std::vector<Case> cases = {
      {"a sequence reads past the rows the layers hold",
       [](std::vector<SequenceRowsIn>& r, std::vector<LayerRows>&) { r[1].shared_first = 3; },
       absl::StatusCode::kInvalidArgument},
      {"one entry holds fewer rows than the others",
       [](std::vector<SequenceRowsIn>&, std::vector<LayerRows>& l) { l[2].ckv_bytes -= 1024; },
       absl::StatusCode::kInvalidArgument},
      {"a layer named twice",
       [](std::vector<SequenceRowsIn>&, std::vector<LayerRows>& l) { l[2].layer = 0; },
       absl::StatusCode::kInvalidArgument},
      {"a layer outside the pool",
       [](std::vector<SequenceRowsIn>&, std::vector<LayerRows>& l) { l[1].layer = kLayers; },
       absl::StatusCode::kOutOfRange},
      {"scales other than the configured ones",
       [](std::vector<SequenceRowsIn>&, std::vector<LayerRows>& l) { l[0].ckv_scale = l[0].kpe_scale = 2.0f; },
       absl::StatusCode::kFailedPrecondition},
      {"the second sequence expects another length",
       [](std::vector<SequenceRowsIn>& r, std::vector<LayerRows>&) { r[1].expect_length = 4; },
       absl::StatusCode::kFailedPrecondition},
      {"the second sequence would leave a hole",
       [](std::vector<SequenceRowsIn>& r, std::vector<LayerRows>&) { r[1].start = 1; },
       absl::StatusCode::kOutOfRange},
  };
  for (const Case& c : cases) {
    TestPool t = MakePool();
    std::vector<LayerRows> layers = b.shared;
    std::vector<SequenceRowsIn> rows = SharedRows(b, 0);
    c.spoil(rows, layers);
    for (SequenceRowsIn& r : rows) r.shared_layers = layers;
    const absl::Status s = Apply(*t.pool, b.ids, rows);
    EXPECT_EQ(s.code(), c.code) << c.what << ": " << s;
    const PoolSnapshot snap = t.pool->Snapshot();
    EXPECT_EQ(snap.pages_used, 0) << c.what;
    EXPECT_EQ(snap.sequences, 0u) << c.what;
    EXPECT_TRUE(t.backend->calls.empty()) << c.what;
    EXPECT_TRUE(t.pool->CheckInvariants().ok()) << c.what << ": " << t.pool->CheckInvariants();
  }
}

TEST(PoolSharedLayersTest, TwoSetsOfSharedLayersInOneCallAreABug) {
  const Batch a = MakeBatch({1, 1}, 51), b = MakeBatch({1, 1}, 61);
  TestPool t = MakePool();
  std::vector<SequenceRowsIn> rows = SharedRows(a, 0);
  rows[1].shared_layers = b.shared;
  EXPECT_EQ(Apply(*t.pool, a.ids, rows).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(t.pool->Snapshot().pages_used, 0);
}

// The decode step's fast path (every layer written, nothing rewritten, a
// transaction's first rows: all its layers marked at once and each layer's
// staged users counted once per call) beside the per-layer path in one call,
// and undone by an abort after staging. CheckInvariants bounds every layer's
// staged users by the appends in flight, so a count the fast path forgot to
// take or give back fails it.
TEST(PoolSharedLayersTest, EveryLayerStepsBesideRewritesAndPartialLayersKeepTheLayersCounts) {
  TestPool shared = MakePool(), own = MakePool();
  auto both = [&](const Batch& b, std::vector<SequenceRowsIn> rows, std::vector<SequenceRowsIn> rows_own) {
    ASSERT_TRUE(Apply(*shared.pool, b.ids, rows).ok());
    ASSERT_TRUE(Apply(*own.pool, b.ids, rows_own).ok());
    ASSERT_TRUE(shared.pool->CheckInvariants().ok()) << shared.pool->CheckInvariants();
  };
  auto tokens_per_layer = [&] {
    std::vector<uint64_t> t;
    for (const LayerSnapshot& l : shared.pool->Snapshot().layers) t.push_back(l.tokens);
    return t;
  };
  const Batch first = MakeBatch({4, 4, 4}, 81);
  both(first, SharedRows(first, 0), OwnRows(first, 0));

  // One call: s0 and s2 at their end (the fast path), s1 rewriting its last
  // token (per layer, with undo).
  const Batch second = MakeBatch({1, 2, 1}, 91);
  std::vector<SequenceRowsIn> step = SharedRows(second, 0), step_own = OwnRows(second, 0);
  for (auto* rows : {&step, &step_own}) {
    (*rows)[0].start = 4;
    (*rows)[1].start = 3;
    (*rows)[2].start = 4;
  }
  both(second, step, step_own);
  EXPECT_EQ(tokens_per_layer(), (std::vector<uint64_t>{15, 15, 15}));

  // A step on the fast path, staged, then aborted by the last check: the
  // counts hold while it is in flight, nothing is committed, all given back.
  const std::string before = Stored(*shared.pool, "s0", 5);
  const Batch doomed = MakeBatch({1, 1, 1}, 111);
  {
    std::vector<SequenceRowsIn> rows = SharedRows(doomed, 5);
    AtomicAppend append(shared.pool.get());
    for (const std::string& id : doomed.ids) ASSERT_TRUE(append.Begin(id).ok());
    std::vector<const SequenceRowsIn*> ptrs;
    for (const SequenceRowsIn& r : rows) ptrs.push_back(&r);
    ASSERT_TRUE(append.Stage(ptrs, DType::kBFloat16).ok());
    EXPECT_TRUE(shared.pool->CheckInvariants().ok()) << "in flight: " << shared.pool->CheckInvariants();
    const absl::Status s = append.Commit([] { return absl::CancelledError("the client went away"); }).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  }
  ASSERT_TRUE(shared.pool->CheckInvariants().ok()) << shared.pool->CheckInvariants();
  EXPECT_EQ(Stored(*shared.pool, "s0", 5), before);
  EXPECT_EQ(tokens_per_layer(), (std::vector<uint64_t>{15, 15, 15}));

  // Shared rows for two of the three layers only: per layer, layer 2 untouched.
  const Batch third = MakeBatch({1, 1, 1}, 101);
  std::vector<SequenceRowsIn> partial = SharedRows(third, 5), partial_own = OwnRows(third, 5);
  const std::vector<LayerRows> two_layers(third.shared.begin(), third.shared.begin() + 2);
  for (size_t i = 0; i < partial.size(); ++i) {
    partial[i].shared_layers = two_layers;
    partial_own[i].layers.pop_back();
  }
  both(third, partial, partial_own);
  EXPECT_EQ(tokens_per_layer(), (std::vector<uint64_t>{18, 18, 15}));

  // Every layer from 5: a rewrite of layers 0 and 1 (per layer), then every
  // layer at its end again (the fast path).
  const Batch fourth = MakeBatch({1, 1, 1}, 121), fifth = MakeBatch({1, 1, 1}, 131);
  both(fourth, SharedRows(fourth, 5), OwnRows(fourth, 5));
  EXPECT_EQ(tokens_per_layer(), (std::vector<uint64_t>{18, 18, 18}));
  both(fifth, SharedRows(fifth, 6), OwnRows(fifth, 6));
  EXPECT_EQ(tokens_per_layer(), (std::vector<uint64_t>{21, 21, 21}));
  for (const std::string& id : first.ids) {
    ASSERT_EQ(shared.pool->GetSequence(id)->length, 7u) << id;
    EXPECT_EQ(Stored(*shared.pool, id, 7), Stored(*own.pool, id, 7)) << id;
  }
}

}  // namespace
}  // namespace mlakv::server
