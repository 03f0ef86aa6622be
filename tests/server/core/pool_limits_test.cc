// Pool (cpu backend): the promises of docs/reliability.md that live in the
// core model — shape is judged before capacity, the sequence cap, nothing
// left behind by calls that hold nothing, expect_length, the idle reaper
// reading only what it frees, bounded quoting of ids.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "absl/strings/match.h"
#include "server/core/atomic_append.h"
#include "server/core/pool.h"

namespace mlakv::server {
namespace {

constexpr float kCkv = 0.125f, kKpe = 0.5f;

std::unique_ptr<Pool> MakePool(int32_t layers = 2, int32_t page_size = 4, int32_t pages = 16,
                               uint32_t max_sequences = 1u << 20, absl::Duration ttl = absl::ZeroDuration()) {
  Pool::Options o;
  o.name = "p";
  o.device = Device::Cpu();
  o.num_layers = layers;
  o.page_size = page_size;
  o.num_pages = pages;
  o.max_sequences = max_sequences;
  o.idle_ttl = ttl;
  auto pool = Pool::Create(o);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(*pool) : nullptr;
}

struct RowBytes {
  std::string ckv, kpe;
  explicit RowBytes(uint32_t n, uint32_t seed = 1) : ckv(n * 1024, '\0'), kpe(n * 128, '\0') {
    std::mt19937 gen(seed);
    for (size_t i = 0; i < ckv.size(); i += 2) ckv[i + 1] = static_cast<char>(0x3c + gen() % 4), ckv[i] = gen();
    for (size_t i = 0; i < kpe.size(); i += 2) kpe[i + 1] = static_cast<char>(0x3c + gen() % 4), kpe[i] = gen();
  }
};

SequenceRowsIn Rows(const RowBytes& b, uint32_t start, uint32_t n, std::vector<int64_t> layers) {
  SequenceRowsIn r;
  r.start = start;
  r.row_count = n;
  for (int64_t l : layers) r.layers.push_back(LayerRows::FromBytes(static_cast<int32_t>(l), b.ckv, b.kpe, kCkv, kKpe));
  return r;
}

// One whole append of `rows` to `id`; the status of whichever step failed.
absl::Status AppendOnce(Pool& pool, const std::string& id, const SequenceRowsIn& rows) {
  AtomicAppend a(&pool);
  if (absl::Status s = a.Begin(id); !s.ok()) return s;
  const SequenceRowsIn* r = &rows;
  if (absl::Status s = a.Stage({&r, 1}, DType::kBFloat16); !s.ok()) return s;
  return a.Commit([] { return absl::OkStatus(); }).status();
}

void ExpectInvariants(const Pool& pool) {
  const absl::Status s = pool.CheckInvariants();
  EXPECT_TRUE(s.ok()) << s;
}

// ---- shape before capacity ----

TEST(PoolLimits, HugeRowCountIsInvalidArgumentNotResourceExhausted) {
  auto pool = MakePool();
  SequenceRowsIn r;
  r.start = 0;
  r.row_count = 0xffffffffu;
  r.layers.push_back(LayerRows::FromBytes(0, "", "", kCkv, kKpe));
  const absl::Status s = AppendOnce(*pool, "s", r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(pool->Snapshot().pages_used, 0);
  ExpectInvariants(*pool);
}

TEST(PoolLimits, PositionsPastInt32AreOutOfRangeBeforeCapacity) {
  auto pool = MakePool();
  RowBytes b(2);
  const absl::Status s = AppendOnce(*pool, "s", Rows(b, 0x7fffffffu, 2, {0}));
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "int32")) << s;
}

TEST(PoolLimits, WrongBytesBeatAFullPool) {
  auto pool = MakePool(1, 4, 1);
  RowBytes b(8);
  SequenceRowsIn r = Rows(b, 0, 8, {0});
  --r.layers[0].kpe_bytes;  // one byte short, and 8 rows would not fit either
  EXPECT_EQ(AppendOnce(*pool, "s", r).code(), absl::StatusCode::kInvalidArgument);
  r = Rows(b, 0, 8, {0});
  EXPECT_EQ(AppendOnce(*pool, "s", r).code(), absl::StatusCode::kResourceExhausted);
}

TEST(PoolLimits, HoleBeatsAFullPool) {
  auto pool = MakePool(1, 4, 1);
  RowBytes b(8);
  EXPECT_EQ(AppendOnce(*pool, "s", Rows(b, 3, 8, {0})).code(), absl::StatusCode::kOutOfRange);
}

// ---- the sequence cap ----

TEST(PoolLimits, MaxSequencesRefusesANewIdButNotAnExistingOne) {
  auto pool = MakePool(1, 4, 16, /*max_sequences=*/2);
  RowBytes b(1);
  ASSERT_TRUE(AppendOnce(*pool, "a", Rows(b, 0, 1, {0})).ok());
  ASSERT_TRUE(AppendOnce(*pool, "b", Rows(b, 0, 1, {0})).ok());
  const absl::Status s = AppendOnce(*pool, "c", Rows(b, 0, 1, {0}));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "max_sequences")) << s;
  EXPECT_TRUE(AppendOnce(*pool, "a", Rows(b, 1, 1, {0})).ok());
  ASSERT_TRUE(pool->FreeSequence("b").ok());
  EXPECT_TRUE(AppendOnce(*pool, "c", Rows(b, 0, 1, {0})).ok());
  ExpectInvariants(*pool);
}

TEST(PoolLimits, AnAppendInFlightCountsAgainstTheCap) {
  auto pool = MakePool(1, 4, 16, /*max_sequences=*/1);
  auto open = pool->BeginAppend("first");
  ASSERT_TRUE(open.ok());
  EXPECT_EQ(pool->BeginAppend("second").status().code(), absl::StatusCode::kResourceExhausted);
  pool->Abort(**open);
  auto again = pool->BeginAppend("second");
  EXPECT_TRUE(again.ok()) << again.status();
  pool->Abort(**again);
  ExpectInvariants(*pool);
}

// ---- nothing left behind ----

TEST(PoolLimits, ZeroRowAppendToANewIdLeavesNoSequence) {
  auto pool = MakePool();
  SequenceRowsIn none;
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(AppendOnce(*pool, "empty-" + std::to_string(i), none).ok());
  EXPECT_EQ(pool->Snapshot().sequences, 0u);
  EXPECT_EQ(pool->GetSequence("empty-3").status().code(), absl::StatusCode::kNotFound);
  ExpectInvariants(*pool);
}

TEST(PoolLimits, AReservationAloneKeepsTheSequence) {
  auto pool = MakePool();
  SequenceRowsIn reserve;
  reserve.reserve_tokens = 5;
  ASSERT_TRUE(AppendOnce(*pool, "r", reserve).ok());
  auto s = pool->GetSequence("r");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->kv_indices.size(), 2u);
  ExpectInvariants(*pool);
}

TEST(PoolLimits, ZeroRowAppendToAnExistingSequenceKeepsIt) {
  auto pool = MakePool();
  RowBytes b(3);
  ASSERT_TRUE(AppendOnce(*pool, "s", Rows(b, 0, 3, {0, 1})).ok());
  ASSERT_TRUE(AppendOnce(*pool, "s", SequenceRowsIn{}).ok());
  EXPECT_EQ(pool->GetSequence("s")->length, 3u);
}

TEST(PoolLimits, TruncateToZeroRemovesTheSequenceAndItsPages) {
  auto pool = MakePool();
  RowBytes b(6);
  ASSERT_TRUE(AppendOnce(*pool, "s", Rows(b, 0, 6, {0, 1})).ok());
  auto cut = pool->TruncateSequence("s", 0);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->length, 0u);
  EXPECT_TRUE(cut->kv_indices.empty());
  EXPECT_EQ(pool->GetSequence("s").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool->Snapshot().pages_used, 0);
  ExpectInvariants(*pool);
}

// ---- expect_length ----

TEST(PoolLimits, ExpectLengthAppliesOnlyAtThatLength) {
  auto pool = MakePool();
  RowBytes b(4);
  SequenceRowsIn first = Rows(b, 0, 4, {0, 1});
  first.expect_length = 0;  // a new sequence holds 0
  ASSERT_TRUE(AppendOnce(*pool, "s", first).ok());
  // The same call again (a retry after a lost response): refused, nothing written.
  const absl::Status retry = AppendOnce(*pool, "s", first);
  EXPECT_EQ(retry.code(), absl::StatusCode::kFailedPrecondition) << retry;
  EXPECT_TRUE(absl::StrContains(retry.message(), "holds 4 tokens, not the 0")) << retry;
  SequenceRowsIn next = Rows(b, 4, 4, {0, 1});
  next.expect_length = 4;
  ASSERT_TRUE(AppendOnce(*pool, "s", next).ok());
  EXPECT_EQ(pool->GetSequence("s")->length, 8u);
  EXPECT_EQ(AppendOnce(*pool, "s", next).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->GetSequence("s")->length, 8u);
  ExpectInvariants(*pool);
}

TEST(PoolLimits, ExpectLengthWithoutLayersChecksTheSequenceLength) {
  auto pool = MakePool();
  RowBytes b(4);
  ASSERT_TRUE(AppendOnce(*pool, "s", Rows(b, 0, 4, {0})).ok());  // layer 0: 4, layer 1: 0 -> length 0
  SequenceRowsIn probe;
  probe.expect_length = 4;
  EXPECT_EQ(AppendOnce(*pool, "s", probe).code(), absl::StatusCode::kFailedPrecondition);
  probe.expect_length = 0;
  EXPECT_TRUE(AppendOnce(*pool, "s", probe).ok());
}

// Layers of unequal length: the checks that a decode step settles from the
// least and most committed length (every layer equal) still look at each
// layer when they differ, and name the one that fails.
TEST(PoolLimits, UnequalLayersAreCheckedLayerByLayer) {
  auto pool = MakePool();  // 2 layers, 4-token pages
  const RowBytes b(8), four(4), two(2, 7), one(1);  // the rows point into these
  ASSERT_TRUE(AppendOnce(*pool, "s", Rows(b, 0, 8, {0})).ok());
  ASSERT_TRUE(AppendOnce(*pool, "s", Rows(four, 0, 4, {1})).ok());  // layer 0: 8, layer 1: 4
  // expect_length: right for the layer written, wrong for the other.
  SequenceRowsIn on1 = Rows(two, 4, 2, {1});
  on1.expect_length = 4;
  ASSERT_TRUE(AppendOnce(*pool, "s", on1).ok());  // layer 1: 6
  SequenceRowsIn both = Rows(two, 6, 2, {0, 1});
  both.expect_length = 6;
  absl::Status st = AppendOnce(*pool, "s", both);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "layer 0 holds 8 tokens, not the 6")) << st;
  // No holes: start 7 is inside layer 0 (8) but past layer 1 (6).
  st = AppendOnce(*pool, "s", Rows(two, 7, 2, {0, 1}));
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "layer 1: start 7 would leave a hole; the layer holds 6")) << st;
  // A rewrite of layer 0's committed positions 6..8 beside new rows on layer 1.
  ASSERT_TRUE(AppendOnce(*pool, "s", Rows(two, 6, 2, {0, 1})).ok());
  absl::StatusOr<SequenceSnapshot> snap = pool->GetSequence("s");
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->length, 8u);
  EXPECT_EQ(snap->layer_lengths, (std::vector<uint32_t>{8, 8}));
  // Equal again: a decode-style append (expect_length, start at the end) passes.
  SequenceRowsIn step = Rows(one, 8, 1, {0, 1});
  step.expect_length = 8;
  ASSERT_TRUE(AppendOnce(*pool, "s", step).ok());
  EXPECT_EQ(pool->GetSequence("s")->length, 9u);
  ExpectInvariants(*pool);
}

// ---- the idle reaper reads the use order ----

TEST(PoolLimits, FreeIdleFreesOnlyTheExpiredOldestFirstInBatches) {
  auto pool = MakePool(1, 1, 64, 1u << 20, absl::Seconds(10));
  RowBytes b(1);
  for (int i = 0; i < 40; ++i) ASSERT_TRUE(AppendOnce(*pool, "s" + std::to_string(i), Rows(b, 0, 1, {0})).ok());
  // All 40 were used within the last second, so 11 s from now all have
  // expired; with batches of 7 the reaper takes the lock 6 times.
  EXPECT_EQ(pool->FreeIdle(absl::Now() + absl::Seconds(11), /*max_batch=*/7), 40);
  EXPECT_EQ(pool->Snapshot().sequences, 0u);
  ExpectInvariants(*pool);
}

TEST(PoolLimits, FreeIdleStopsAtTheFirstRecentSequence) {
  auto pool = MakePool(1, 1, 64, 1u << 20, absl::Seconds(10));
  RowBytes b(1);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(AppendOnce(*pool, "s" + std::to_string(i), Rows(b, 0, 1, {0})).ok());
  // Nothing is older than 10 s now.
  EXPECT_EQ(pool->FreeIdle(absl::Now()), 0);
  EXPECT_EQ(pool->Snapshot().sequences, 5u);
}

TEST(PoolLimits, AnAppendInFlightIsNeverReaped) {
  auto pool = MakePool(1, 1, 64, 1u << 20, absl::Seconds(1));
  RowBytes b(1);
  ASSERT_TRUE(AppendOnce(*pool, "busy", Rows(b, 0, 1, {0})).ok());
  ASSERT_TRUE(AppendOnce(*pool, "idle", Rows(b, 0, 1, {0})).ok());
  auto open = pool->BeginAppend("busy");
  ASSERT_TRUE(open.ok());
  EXPECT_EQ(pool->FreeIdle(absl::Now() + absl::Hours(1)), 1);  // only "idle"
  EXPECT_EQ(pool->GetSequence("idle").status().code(), absl::StatusCode::kNotFound);
  pool->Abort(**open);
  EXPECT_TRUE(pool->GetSequence("busy").ok());
  ExpectInvariants(*pool);
}

// ---- reads ----

TEST(PoolLimits, ReadNamingALayerTwiceIsInvalidArgument) {
  auto pool = MakePool();
  RowBytes b(2);
  ASSERT_TRUE(AppendOnce(*pool, "s", Rows(b, 0, 2, {0, 1})).ok());
  uint32_t count = 0;
  const std::vector<uint32_t> layers = {1, 0, 1};
  EXPECT_EQ(pool->PlanRead("s", layers, 0, &count).status().code(), absl::StatusCode::kInvalidArgument);
}

// ---- quoting ----

TEST(PoolLimits, StatusesQuoteLongAndControlCharacterIdsBoundedAndEscaped) {
  auto pool = MakePool();
  const std::string long_id(70000, 'x');
  const absl::Status s = pool->GetSequence(long_id).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_LT(s.message().size(), 400u) << s.message().size();
  const absl::Status nl = pool->GetSequence("a\nb").status();
  EXPECT_TRUE(absl::StrContains(nl.message(), "'a\\nb'")) << nl;
  EXPECT_FALSE(absl::StrContains(nl.message(), "\n")) << nl;
  EXPECT_EQ(pool->BeginAppend(std::string(1025, 'y')).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace mlakv::server
