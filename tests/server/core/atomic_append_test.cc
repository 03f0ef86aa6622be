// AtomicAppend: the transaction sequence the RPC layer drives (begin, stage,
// commit with a last check, or abort), over a cpu pool.
#include "server/core/atomic_append.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

namespace mlakv::server {
namespace {

constexpr float kCkv = 0.125f, kKpe = 0.5f;

std::unique_ptr<Pool> MakePool() {
  Pool::Options o;
  o.name = "p";
  o.device = Device::Cpu();
  o.num_layers = 2;
  o.page_size = 4;
  o.num_pages = 16;
  auto pool = Pool::Create(o);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return std::move(*pool);
}

struct Bytes {
  std::string ckv, kpe;
  explicit Bytes(uint32_t n) : ckv(n * 1024, '\0'), kpe(n * 128, '\0') {
    std::mt19937 gen(n);
    for (size_t i = 0; i < ckv.size(); i += 2) ckv[i + 1] = static_cast<char>(0x3c + gen() % 4);
    for (size_t i = 0; i < kpe.size(); i += 2) kpe[i + 1] = static_cast<char>(0x3c + gen() % 4);
  }
};

SequenceRowsIn Rows(const Bytes& b, uint32_t start, uint32_t n) {
  SequenceRowsIn r;
  r.start = start;
  r.row_count = n;
  for (int32_t l : {0, 1}) {
    r.layers.push_back({.layer = l,
                        .source = {.ckv = b.ckv.data(), .kpe = b.kpe.data()},
                        .ckv_bytes = b.ckv.size(),
                        .kpe_bytes = b.kpe.size(),
                        .ckv_scale = kCkv,
                        .kpe_scale = kKpe});
  }
  return r;
}

absl::Status Ok() { return absl::OkStatus(); }

TEST(AtomicAppend, CommitsEveryTransactionInBeginOrder) {
  auto pool = MakePool();
  AtomicAppend a(pool.get());
  ASSERT_TRUE(a.Begin("x").ok());
  ASSERT_TRUE(a.Begin("y").ok());
  Bytes bx(3), by(2);
  const SequenceRowsIn rx = Rows(bx, 0, 3), ry = Rows(by, 0, 2);
  const SequenceRowsIn* rows[] = {&rx, &ry};
  ASSERT_TRUE(a.Stage(rows, DType::kBFloat16).ok());
  EXPECT_EQ(a.rows_written(), 10u);  // (3 + 2) rows x 2 layers
  EXPECT_EQ(a.pages_allocated(), 2u);
  auto after = a.Commit(Ok);
  ASSERT_TRUE(after.ok()) << after.status();
  ASSERT_EQ(after->size(), 2u);
  EXPECT_EQ((*after)[0].id, "x");
  EXPECT_EQ((*after)[0].length, 3u);
  EXPECT_EQ((*after)[1].length, 2u);
  EXPECT_TRUE(a.finished());
  EXPECT_TRUE(pool->CheckInvariants().ok());
}

SequenceRowsIn WithScales(SequenceRowsIn r, float ckv, float kpe) {
  for (LayerRows& l : r.layers) {
    l.ckv_scale = ckv;
    l.kpe_scale = kpe;
  }
  return r;
}

// A call whose second sequence sets new scales on layers left empty, and
// whose first writes them without naming any: the failed call leaves the
// old scales (the first sequence's abort came after the second's, while it
// still counted as a user of the layers, and the restore was skipped).
TEST(AtomicAppend, AFailedCallLeavesTheScalesItChanged) {
  auto pool = MakePool();
  Bytes b(2);
  {
    AtomicAppend a(pool.get());
    ASSERT_TRUE(a.Begin("old").ok());
    const SequenceRowsIn r = Rows(b, 0, 2);
    const SequenceRowsIn* rows[] = {&r};
    ASSERT_TRUE(a.Stage(rows, DType::kBFloat16).ok());
    ASSERT_TRUE(a.Commit(Ok).ok());
  }
  ASSERT_TRUE(pool->FreeSequence("old").ok());  // the layers are empty: their scales may change
  for (const bool fail_in_stage : {false, true}) {
    SCOPED_TRACE(fail_in_stage ? "fails in stage" : "fails at the last check");
    AtomicAppend a(pool.get());
    ASSERT_TRUE(a.Begin("x").ok());
    ASSERT_TRUE(a.Begin("y").ok());
    const SequenceRowsIn rx = WithScales(Rows(b, 0, 2), 0, 0), ry = WithScales(Rows(b, 0, 2), 0.25f, 1.0f);
    // Failing in stage: a third sequence with a hole after the two.
    const SequenceRowsIn rz = Rows(b, 7, 2);
    std::vector<const SequenceRowsIn*> rows = {&rx, &ry};
    if (fail_in_stage) {
      ASSERT_TRUE(a.Begin("z").ok());
      rows.push_back(&rz);
      EXPECT_FALSE(a.Stage(rows, DType::kBFloat16).ok());
      a.Abort();
    } else {
      ASSERT_TRUE(a.Stage(rows, DType::kBFloat16).ok());
      EXPECT_EQ(pool->Snapshot().layers[0].ckv_scale, 0.25f);
      EXPECT_EQ(a.Commit([] { return absl::DeadlineExceededError("late"); }).status().code(),
                absl::StatusCode::kDeadlineExceeded);
    }
    const PoolSnapshot s = pool->Snapshot();
    for (int l : {0, 1}) {
      EXPECT_TRUE(s.layers[l].scales_set);
      EXPECT_EQ(s.layers[l].ckv_scale, kCkv) << "layer " << l;
      EXPECT_EQ(s.layers[l].kpe_scale, kKpe) << "layer " << l;
      EXPECT_EQ(s.layers[l].tokens, 0u);
    }
    EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  }
}

TEST(AtomicAppend, AFailingLastCheckAbortsAndReturnsItsStatus) {
  auto pool = MakePool();
  AtomicAppend a(pool.get());
  ASSERT_TRUE(a.Begin("x").ok());
  Bytes b(5);
  const SequenceRowsIn r = Rows(b, 0, 5);
  const SequenceRowsIn* rows[] = {&r};
  ASSERT_TRUE(a.Stage(rows, DType::kBFloat16).ok());
  EXPECT_EQ(pool->Snapshot().pages_used, 2);
  auto after = a.Commit([] { return absl::DeadlineExceededError("too late"); });
  EXPECT_EQ(after.status(), absl::DeadlineExceededError("too late"));
  EXPECT_EQ(pool->Snapshot().pages_used, 0);
  EXPECT_EQ(pool->GetSequence("x").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(pool->CheckInvariants().ok());
}

TEST(AtomicAppend, DestroyingAnOpenAppendRollsItBack) {
  auto pool = MakePool();
  Bytes b(4);
  {
    AtomicAppend a(pool.get());
    ASSERT_TRUE(a.Begin("x").ok());
    const SequenceRowsIn r = Rows(b, 0, 4);
    const SequenceRowsIn* rows[] = {&r};
    ASSERT_TRUE(a.Stage(rows, DType::kBFloat16).ok());
  }
  EXPECT_EQ(pool->Snapshot().pages_used, 0);
  EXPECT_TRUE(pool->BeginAppend("x").ok());  // no longer busy
}

TEST(AtomicAppend, AbortIsIdempotentAndNothingAfterIt) {
  auto pool = MakePool();
  AtomicAppend a(pool.get());
  ASSERT_TRUE(a.Begin("x").ok());
  a.Abort();
  a.Abort();
  EXPECT_EQ(a.Begin("y").code(), absl::StatusCode::kInternal);
  EXPECT_EQ(a.Commit(Ok).status().code(), absl::StatusCode::kInternal);
}

TEST(AtomicAppend, BeginPassesThePoolsRefusal) {
  auto pool = MakePool();
  AtomicAppend first(pool.get());
  ASSERT_TRUE(first.Begin("x").ok());
  AtomicAppend second(pool.get());
  EXPECT_EQ(second.Begin("x").code(), absl::StatusCode::kAborted);
  EXPECT_EQ(second.Begin("").code(), absl::StatusCode::kInvalidArgument);
}

TEST(AtomicAppend, BeginningSeveralStopsAtTheFirstRefusalAndAbortLeavesNothing) {
  auto pool = MakePool();
  Bytes b(2);
  {  // "held" committed with 2 tokens, then held busy by another append
    AtomicAppend setup(pool.get());
    ASSERT_TRUE(setup.Begin("held").ok());
    const SequenceRowsIn r = Rows(b, 0, 2);
    const SequenceRowsIn* rows[] = {&r};
    ASSERT_TRUE(setup.Stage(rows, DType::kBFloat16).ok());
    ASSERT_TRUE(setup.Commit(Ok).ok());
  }
  AtomicAppend holder(pool.get());
  ASSERT_TRUE(holder.Begin("held").ok());
  const std::string a = "new-a", held = "held", c = "new-c";
  const std::string* ids[] = {&a, &held, &c};
  AtomicAppend batch(pool.get());
  EXPECT_EQ(batch.Begin(ids).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(batch.size(), 1u) << "the sequences begun before the refusal, and no more";
  batch.Abort();
  EXPECT_EQ(pool->GetSequence("new-a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool->GetSequence("new-c").status().code(), absl::StatusCode::kNotFound);
  holder.Abort();
  EXPECT_EQ(pool->GetSequence("held")->length, 2u);
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
  // All at once when none is refused; committed under one hold of the lock.
  const std::string* fresh[] = {&a, &c};
  AtomicAppend ok(pool.get());
  ASSERT_TRUE(ok.Begin(fresh).ok());
  Bytes one(1);
  const SequenceRowsIn ra = Rows(b, 0, 2), rc = Rows(one, 0, 1);
  const SequenceRowsIn* rows[] = {&ra, &rc};
  ASSERT_TRUE(ok.Stage(rows, DType::kBFloat16).ok());
  auto after = ok.Commit(Ok);
  ASSERT_TRUE(after.ok()) << after.status();
  ASSERT_EQ(after->size(), 2u);
  EXPECT_EQ((*after)[0].id, "new-a");
  EXPECT_EQ((*after)[1].length, 1u);
  EXPECT_TRUE(pool->CheckInvariants().ok()) << pool->CheckInvariants();
}

}  // namespace
}  // namespace mlakv::server
