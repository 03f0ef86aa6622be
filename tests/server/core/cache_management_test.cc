// The pool's cache management (CPU backend): generations, leases and the
// sequences they retain, eviction (exact LRU order), forks and
// copy-on-write, the block-hash prefix index; every new error with its
// status; and a random interleaving of all of it against a reference model
// (bytes of every live sequence and of every lease, invariants after every
// step).
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <map>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "kernels/nvfp4_format.h"
#include "server/core/pool.h"
#include "tests/server/core/random_rows.h"

namespace mlakv::server {
namespace {

constexpr float kCkv = 0.25f, kKpe = 0.5f;

// A settable clock for TTLs, leases and eviction records.
struct FakeClock {
  absl::Time now = absl::FromUnixSeconds(1'700'000'000);
};

using testing::Entry;
using Layers = std::vector<std::vector<Entry>>;  // [layer][position]
using Rows = testing::RowSet;
Rows MakeRows(uint32_t n, uint32_t seed) { return testing::MakeRows(n, seed, kCkv, kKpe); }

class CacheTest : public ::testing::Test {
 protected:
  void MakePool(int32_t pages, int32_t page_size = 4, int32_t layers = 2, bool lru = false) {
    Pool::Options o;
    o.name = "p";
    o.num_layers = layers;
    o.page_size = page_size;
    o.num_pages = pages;
    o.eviction.lru = lru;
    o.clock = [this] { return clock_.now; };
    auto pool = Pool::Create(o);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
  }

  // Appends n rows at `start` to every layer; `extra` fills in the rest.
  absl::StatusOr<SequenceSnapshot> Append(const std::string& id, uint32_t start, uint32_t n, uint32_t seed,
                                          const std::function<void(SequenceRowsIn&)>& extra = nullptr,
                                          std::vector<int64_t> layers = {}) {
    if (layers.empty()) {
      for (int32_t l = 0; l < pool_->num_layers(); ++l) layers.push_back(l);
    }
    Rows rows = MakeRows(n, seed);
    SequenceRowsIn in;
    in.start = start;
    in.row_count = n;
    for (int64_t l : layers) in.layers.push_back(LayerRows::FromBytes(static_cast<int32_t>(l), rows.ckv, rows.kpe, kCkv, kKpe));
    if (extra) extra(in);
    auto txn = pool_->BeginAppend(id);
    if (!txn.ok()) return txn.status();
    AppendTransaction* t = txn->get();
    const SequenceRowsIn* r = &in;
    if (absl::Status s = pool_->Stage({&t, 1}, {&r, 1}, DType::kBFloat16); !s.ok()) {
      pool_->Abort(*t);
      return s;
    }
    SequenceSnapshot snap = pool_->Commit(*t);
    Layers& model = model_[id];
    model.resize(pool_->num_layers());
    for (int64_t l : layers) {
      model[l].resize(std::max<size_t>(model[l].size(), start + n));
      for (uint32_t i = 0; i < n; ++i) model[l][start + i] = rows.expected[i];
    }
    return snap;
  }

  // Every stored entry of [0, count) of every layer, through `ref`.
  absl::StatusOr<Layers> Read(const SequenceRef& ref, uint32_t count) {
    Layers out(pool_->num_layers(), std::vector<Entry>(count));
    for (int32_t l = 0; l < pool_->num_layers(); ++l) {
      std::vector<uint8_t> ckv(count * 256), sf(count * 32), kpe(count * 64);
      LayerSnapshot st;
      if (absl::Status s = pool_->ReadRows(ref, l, 0, count, {ckv.data(), sf.data(), kpe.data()}, &st); !s.ok()) {
        return s;
      }
      for (uint32_t i = 0; i < count; ++i) {
        std::memcpy(out[l][i].data(), ckv.data() + i * 256, 256);
        std::memcpy(out[l][i].data() + 256, sf.data() + i * 32, 32);
        std::memcpy(out[l][i].data() + 288, kpe.data() + i * 64, 64);
      }
    }
    return out;
  }

  // The model's first `count` tokens of `id`.
  Layers Expected(const std::string& id, uint32_t count) {
    Layers out = model_[id];
    for (auto& l : out) l.resize(count);
    return out;
  }

  void ExpectInvariants() {
    absl::Status s = pool_->CheckInvariants();
    EXPECT_TRUE(s.ok()) << s;
    const PoolSnapshot p = pool_->Snapshot();
    EXPECT_EQ(p.pages_free + p.pages_used, p.pages_total);
  }

  FakeClock clock_;
  std::unique_ptr<Pool> pool_;
  std::map<std::string, Layers> model_;
};

// ---- generations ----------------------------------------------------------------

TEST_F(CacheTest, GenerationsAreNeverReusedAndCallsMayPinThem) {
  MakePool(8);
  auto a = Append("s", 0, 3, 1);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_GT(a->generation, 0u);
  ASSERT_TRUE(pool_->FreeSequence("s").ok());
  auto b = Append("s", 0, 3, 2);
  ASSERT_TRUE(b.ok());
  EXPECT_GT(b->generation, a->generation) << "a re-created id gets a new generation";
  SequenceRef stale("s");
  stale.expect_generation = a->generation;
  for (const absl::Status& s : {pool_->GetSequence(stale).status(), pool_->FreeSequence(stale).status(),
                                pool_->TruncateSequence(stale, 1).status(), pool_->AcquireLease(stale, {"r"}).status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat(a->generation)) &&
                absl::StrContains(s.message(), absl::StrCat(b->generation)))
        << "names both generations: " << s;
  }
  // An append pinned to the old generation writes nothing.
  auto stale_append = Append("s", 3, 1, 3, [&](SequenceRowsIn& r) { r.expect_generation = a->generation; });
  EXPECT_EQ(stale_append.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool_->GetSequence("s")->length, 3u);
  auto missing = Append("new", 0, 1, 3, [&](SequenceRowsIn& r) { r.expect_generation = 7; });
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  EXPECT_EQ(pool_->GetSequence("new").status().code(), absl::StatusCode::kNotFound);
  SequenceRef current("s");
  current.expect_generation = b->generation;
  EXPECT_TRUE(pool_->GetSequence(current).ok());
  // A zero-row append to a new id keeps nothing and reports no generation.
  auto empty = Append("ghost", 0, 0, 4, nullptr, {});
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->generation, 0u);
  ExpectInvariants();
}

// ---- leases ---------------------------------------------------------------------

TEST_F(CacheTest, LeasedBytesOutliveAFreeAndTheReuseOfTheId) {
  MakePool(6);
  ASSERT_TRUE(Append("s", 0, 10, 1).ok());
  const Layers before = Expected("s", 10);
  auto lease = pool_->AcquireLease("s", {"decode-0", absl::Seconds(5)});
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->tokens, 10u);
  auto freed = pool_->FreeSequence("s");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(freed->leases, 1u);
  EXPECT_EQ(freed->pages_retained, 3u);
  EXPECT_EQ(freed->pages_freed, 0u);
  EXPECT_EQ(pool_->GetSequence("s").status().code(), absl::StatusCode::kNotFound) << "gone for new callers";
  EXPECT_EQ(pool_->Snapshot().sequences_retained, 1u);
  // The id is reused; the pool has 3 free pages for it.
  ASSERT_TRUE(Append("s", 0, 12, 2).ok());
  EXPECT_EQ(Append("other", 0, 1, 3).status().code(), absl::StatusCode::kResourceExhausted)
      << "the leased pages are still used";
  SequenceRef through;
  through.lease_id = lease->id;
  auto read = Read(through, 10);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, before) << "the reader's bytes did not change";
  ExpectInvariants();
  auto released = pool_->ReleaseLease(lease->id);
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(*released, 3u);
  EXPECT_EQ(pool_->Snapshot().pages_used, 3);
  EXPECT_EQ(pool_->Snapshot().sequences_retained, 0u);
  EXPECT_EQ(pool_->ReleaseLease(lease->id).status().code(), absl::StatusCode::kNotFound);
  ExpectInvariants();
}

TEST_F(CacheTest, ALeaseRefusesTruncatesAndRewritesBelowItButNotGrowth) {
  MakePool(8);
  ASSERT_TRUE(Append("s", 0, 6, 1).ok());
  auto lease = pool_->AcquireLease("s", {"r"}, 5);
  ASSERT_TRUE(lease.ok());
  auto cut = pool_->TruncateSequence("s", 4);
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kFailedPrecondition) << cut.status();
  EXPECT_TRUE(pool_->TruncateSequence("s", 5).ok()) << "down to what the lease protects is allowed";
  auto rewrite = Append("s", 4, 2, 2);
  EXPECT_EQ(rewrite.status().code(), absl::StatusCode::kFailedPrecondition) << rewrite.status();
  EXPECT_TRUE(absl::StrContains(rewrite.status().message(), "lease")) << rewrite.status();
  EXPECT_TRUE(Append("s", 5, 3, 3).ok()) << "appends past the leased tokens stay allowed";
  auto read = Read("s", 5);
  ASSERT_TRUE(read.ok());
  model_["s"] = Expected("s", 8);
  EXPECT_EQ(*read, Expected("s", 5));
  ASSERT_TRUE(pool_->ReleaseLease(lease->id).ok());
  EXPECT_TRUE(pool_->TruncateSequence("s", 1).ok());
  ExpectInvariants();
}

TEST_F(CacheTest, LeasesExpireAndTheirRetainedSequencesGoWithThem) {
  MakePool(8);
  ASSERT_TRUE(Append("s", 0, 4, 1).ok());
  auto lease = pool_->AcquireLease("s", {"r", absl::Seconds(2)});
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(lease->expire_unix_ms, absl::ToUnixMillis(clock_.now + absl::Seconds(2)));
  ASSERT_TRUE(pool_->FreeSequence("s").ok());
  clock_.now += absl::Seconds(1);
  auto renewed = pool_->RenewLease(lease->id, absl::Seconds(3));
  ASSERT_TRUE(renewed.ok());
  clock_.now += absl::Seconds(2);
  EXPECT_EQ(pool_->ExpireLeases(), 0) << "renewed to +4 s";
  EXPECT_EQ(pool_->Snapshot().pages_used, 1);
  clock_.now += absl::Seconds(2);
  EXPECT_EQ(pool_->ExpireLeases(), 1);
  EXPECT_EQ(pool_->Snapshot().pages_used, 0);
  EXPECT_EQ(pool_->Snapshot().counters.leases_expired, 1u);
  EXPECT_EQ(pool_->RenewLease(lease->id, absl::Seconds(1)).status().code(), absl::StatusCode::kNotFound);
  ExpectInvariants();
}

TEST_F(CacheTest, ExpiredLeasesProtectNothingEvenBeforeTheReaperRuns) {
  MakePool(8);
  ASSERT_TRUE(Append("s", 0, 4, 1).ok());
  ASSERT_TRUE(pool_->AcquireLease("s", {"r", absl::Seconds(1)}).ok());
  clock_.now += absl::Seconds(1);
  EXPECT_TRUE(pool_->TruncateSequence("s", 1).ok());
  EXPECT_EQ(pool_->Snapshot().leases, 0u);
  ExpectInvariants();
}

TEST_F(CacheTest, LeaseRequestsAreChecked) {
  MakePool(8);
  ASSERT_TRUE(Append("s", 0, 4, 1).ok());
  EXPECT_EQ(pool_->AcquireLease("s", {""}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool_->AcquireLease("s", {std::string(300, 'h')}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool_->AcquireLease("s", {"r", absl::Hours(2)}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool_->AcquireLease("s", {"r"}, 5).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(pool_->AcquireLease("nope", {"r"}).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(Append("one-layer", 0, 4, 2, nullptr, {0}).ok());
  auto nothing = pool_->AcquireLease("one-layer", {"r"});
  EXPECT_EQ(nothing.status().code(), absl::StatusCode::kFailedPrecondition) << nothing.status();
  EXPECT_TRUE(absl::StrContains(nothing.status().message(), "no token in every layer")) << nothing.status();
  for (int i = 0; i < 64; ++i) ASSERT_TRUE(pool_->AcquireLease("s", {"r"}).ok());
  EXPECT_EQ(pool_->AcquireLease("s", {"r"}).status().code(), absl::StatusCode::kResourceExhausted)
      << "max_leases_per_sequence";
  EXPECT_EQ(pool_->ListLeases(1000, 0).leases.size(), 64u);
  ExpectInvariants();
}

TEST_F(CacheTest, GetSequenceTakesALeaseAtomically) {
  MakePool(8);
  ASSERT_TRUE(Append("s", 0, 6, 1).ok());
  auto seq = pool_->GetSequence("s", LeaseRequest{"decode", absl::Seconds(10)});
  ASSERT_TRUE(seq.ok());
  ASSERT_TRUE(seq->lease.has_value());
  EXPECT_EQ(seq->lease->tokens, 6u);
  EXPECT_EQ(seq->leases, 1u);
  EXPECT_EQ(pool_->GetSequence("s")->leases, 1u);
}

// ---- eviction -------------------------------------------------------------------

TEST_F(CacheTest, AFullPoolWithoutEvictionRefuses) {
  MakePool(2);
  ASSERT_TRUE(Append("a", 0, 8, 1).ok());
  auto b = Append("b", 0, 1, 2);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(b.status().message(), "eviction")) << b.status();
  EXPECT_TRUE(pool_->GetSequence("a").ok());
}

TEST_F(CacheTest, EvictionTakesTheLeastRecentlyUsedInExactOrder) {
  MakePool(4, 4, 2, /*lru=*/true);
  for (const char* id : {"a", "b", "c", "d"}) {
    ASSERT_TRUE(Append(id, 0, 4, 1).ok());
    clock_.now += absl::Seconds(1);
  }
  ASSERT_TRUE(pool_->GetSequence("a").ok());  // a is now the most recent
  clock_.now += absl::Seconds(1);
  ASSERT_TRUE(Append("e", 0, 4, 2).ok());     // evicts b
  auto listed = [&] {  // a listing is not a use
    std::vector<std::string> ids;
    for (const auto& e : pool_->ListSequences(100, "").sequences) ids.push_back(e.id);
    return ids;
  };
  EXPECT_EQ(listed(), (std::vector<std::string>{"a", "c", "d", "e"}));
  clock_.now += absl::Seconds(1);
  ASSERT_TRUE(Append("f", 0, 8, 3).ok());     // needs 2: evicts c, then d (a was touched after them)
  for (const char* gone : {"b", "c", "d"}) {
    auto s = pool_->GetSequence(gone);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
    EXPECT_TRUE(absl::StrContains(s.status().message(), "evicted at 2023-11-14T22:13")) << s.status();
  }
  EXPECT_TRUE(pool_->GetSequence("a").ok());
  EXPECT_TRUE(pool_->GetSequence("e").ok());
  EXPECT_EQ(pool_->Snapshot().counters.evictions, 3u);
  EXPECT_EQ(pool_->Snapshot().counters.evicted_pages, 3u);
  ExpectInvariants();
}

TEST_F(CacheTest, EvictionPassesLeasedAndPinnedSequencesBy) {
  MakePool(3, 4, 2, /*lru=*/true);
  ASSERT_TRUE(Append("pinned", 0, 4, 1, [](SequenceRowsIn& r) { r.pin = true; }).ok());
  ASSERT_TRUE(Append("leased", 0, 4, 2).ok());
  ASSERT_TRUE(Append("cold", 0, 4, 3).ok());
  ASSERT_TRUE(pool_->AcquireLease("leased", {"r"}).ok());
  ASSERT_TRUE(Append("new", 0, 4, 4).ok());
  EXPECT_EQ(pool_->GetSequence("cold").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(Append("more", 0, 4, 5).ok());  // evicts "new", the only candidate
  EXPECT_EQ(pool_->GetSequence("new").status().code(), absl::StatusCode::kNotFound);
  auto two = Append("two", 0, 8, 6);  // needs 2 pages; only "more" (1) may go
  EXPECT_EQ(two.status().code(), absl::StatusCode::kResourceExhausted) << two.status();
  EXPECT_TRUE(pool_->GetSequence("more").ok()) << "nothing is evicted for an append that would still not fit";
  EXPECT_TRUE(pool_->GetSequence("pinned").ok());
  EXPECT_TRUE(pool_->GetSequence("leased").ok());
  EXPECT_TRUE(pool_->GetSequence("pinned")->pinned);
  ExpectInvariants();
}

TEST_F(CacheTest, AnAppendThatCannotFitEvictsNothing) {
  MakePool(4, 4, 2, /*lru=*/true);
  ASSERT_TRUE(Append("a", 0, 4, 1).ok());
  ASSERT_TRUE(Append("b", 0, 4, 2).ok());
  ASSERT_TRUE(Append("p", 0, 8, 3, [](SequenceRowsIn& r) { r.pin = true; }).ok());
  auto big = Append("big", 0, 12, 4);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(pool_->GetSequence("a").ok());
  EXPECT_TRUE(pool_->GetSequence("b").ok());
}

TEST_F(CacheTest, WatermarksEvictInTheBackground) {
  Pool::Options o;
  o.name = "p";
  o.num_layers = 1;
  o.page_size = 4;
  o.num_pages = 10;
  o.eviction = {.lru = true, .high_watermark = 0.8, .low_watermark = 0.5};
  o.clock = [this] { return clock_.now; };
  pool_ = *Pool::Create(o);
  for (int i = 0; i < 9; ++i) {
    ASSERT_TRUE(Append(absl::StrCat("s", i), 0, 4, i).ok());
    clock_.now += absl::Seconds(1);
  }
  pool_->Maintain();
  EXPECT_EQ(pool_->Snapshot().pages_used, 5);
  EXPECT_EQ(pool_->GetSequence("s3").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(pool_->GetSequence("s4").ok()) << "the oldest four went";
  ExpectInvariants();
}

// ---- forks and copy-on-write -------------------------------------------------------

TEST_F(CacheTest, AForkSharesFullPagesAndCopiesThePartialOne) {
  MakePool(16);
  ASSERT_TRUE(Append("src", 0, 10, 1).ok());  // pages 0, 1 full, 2 partial
  auto fork = pool_->Fork({.target = "dst", .source = SequenceRef("src"), .length = 10});
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(fork->pages_shared, 2u);
  EXPECT_EQ(fork->pages_copied, 1u);
  const SequenceSnapshot src = *pool_->GetSequence("src");
  EXPECT_EQ(fork->sequence->kv_indices[0], src.kv_indices[0]);
  EXPECT_EQ(fork->sequence->kv_indices[1], src.kv_indices[1]);
  EXPECT_NE(fork->sequence->kv_indices[2], src.kv_indices[2]);
  EXPECT_EQ(fork->sequence->shared_pages, 2u);
  EXPECT_EQ(pool_->Snapshot().pages_used, 4) << "a shared page counts once";
  EXPECT_EQ(pool_->Snapshot().pages_shared, 2);
  model_["dst"] = Expected("src", 10);
  EXPECT_EQ(*Read("dst", 10), Expected("src", 10));
  // Both grow on their own pages.
  ASSERT_TRUE(Append("dst", 10, 3, 2).ok());
  ASSERT_TRUE(Append("src", 10, 2, 3).ok());
  EXPECT_EQ(*Read("src", 12), Expected("src", 12));
  EXPECT_EQ(*Read("dst", 13), Expected("dst", 13));
  // Freeing either leaves the other intact.
  ASSERT_TRUE(pool_->FreeSequence("src").ok());
  EXPECT_EQ(*Read("dst", 13), Expected("dst", 13));
  EXPECT_EQ(pool_->Snapshot().pages_shared, 0);
  ExpectInvariants();
}

TEST_F(CacheTest, ARewriteOfASharedPageCopiesItFirstAndAbortPutsItBack) {
  MakePool(16);
  ASSERT_TRUE(Append("src", 0, 8, 1).ok());
  ASSERT_TRUE(pool_->Fork({.target = "dst", .source = SequenceRef("src"), .length = 8}).ok());
  model_["dst"] = Expected("src", 8);
  const int32_t shared_page = pool_->GetSequence("dst")->kv_indices[0];
  // An aborted rewrite: the shared page is back in the table, bytes unchanged.
  {
    Rows rows = MakeRows(2, 9);
    SequenceRowsIn in;
    in.start = 1;
    in.row_count = 2;
    for (int l = 0; l < 2; ++l) in.layers.push_back(LayerRows::FromBytes(l, rows.ckv, rows.kpe, kCkv, kKpe));
    auto txn = pool_->BeginAppend("dst");
    ASSERT_TRUE(txn.ok());
    AppendTransaction* t = txn->get();
    const SequenceRowsIn* r = &in;
    ASSERT_TRUE(pool_->Stage({&t, 1}, {&r, 1}, DType::kBFloat16).ok());
    ExpectInvariants();
    pool_->Abort(*t);
  }
  EXPECT_EQ(pool_->GetSequence("dst")->kv_indices[0], shared_page);
  EXPECT_EQ(*Read("dst", 8), Expected("dst", 8));
  ExpectInvariants();
  // A committed rewrite: dst gets a private copy; src keeps its bytes.
  ASSERT_TRUE(Append("dst", 1, 2, 10).ok());
  EXPECT_NE(pool_->GetSequence("dst")->kv_indices[0], shared_page);
  EXPECT_EQ(pool_->GetSequence("src")->kv_indices[0], shared_page);
  EXPECT_EQ(*Read("src", 8), Expected("src", 8));
  EXPECT_EQ(*Read("dst", 8), Expected("dst", 8));
  EXPECT_NE(Expected("src", 8), Expected("dst", 8));
  EXPECT_EQ(pool_->Snapshot().counters.pages_copied, 1u);
  // Truncate into the shared second page, then append: copied too.
  ASSERT_TRUE(pool_->TruncateSequence("dst", 6).ok());
  model_["dst"] = Expected("dst", 6);
  ASSERT_TRUE(Append("dst", 6, 2, 11).ok());
  EXPECT_EQ(*Read("src", 8), Expected("src", 8));
  EXPECT_EQ(*Read("dst", 8), Expected("dst", 8));
  EXPECT_EQ(pool_->Snapshot().pages_shared, 0);
  ExpectInvariants();
}

// A leased sequence copies a shared page that holds protected tokens (an
// append past the lease, into a page a fork shares): the page table the
// reader leased still names the old page, so the lease keeps it until it
// ends, even after every other holder let go.
TEST_F(CacheTest, CopyOnWriteKeepsTheOldPageForTheLeaseThatCoversIt) {
  MakePool(6);
  ASSERT_TRUE(Append("src", 0, 8, 1).ok());
  ASSERT_TRUE(pool_->Fork({.target = "dst", .source = SequenceRef("src"), .length = 8}).ok());
  model_["dst"] = Expected("src", 8);
  auto leased = pool_->GetSequence("dst", LeaseRequest{"reader"});
  ASSERT_TRUE(leased.ok());
  const int32_t old_page = leased->kv_indices[0];
  ASSERT_TRUE(pool_->ReleaseLease(leased->lease->id).ok());
  auto lease = pool_->AcquireLease("dst", {"reader"}, 2);  // protects positions 0, 1 of page 0
  ASSERT_TRUE(lease.ok());
  ASSERT_TRUE(Append("dst", 2, 2, 7).ok());  // positions 2, 3: past the lease, in the shared page 0
  EXPECT_NE(pool_->GetSequence("dst")->kv_indices[0], old_page) << "copied";
  ASSERT_TRUE(pool_->FreeSequence("src").ok());
  // Fill the pool: the old page must not be handed out.
  for (int i = 0; pool_->Snapshot().pages_free > 0; ++i) {
    auto filler = Append(absl::StrCat("f", i), 0, 4, 20 + i);
    ASSERT_TRUE(filler.ok()) << filler.status();
    for (int32_t page : filler->kv_indices) EXPECT_NE(page, old_page);
  }
  EXPECT_EQ(pool_->GetPage(old_page)->references, 1) << "held for the lease";
  ExpectInvariants();
  ASSERT_TRUE(pool_->ReleaseLease(lease->id).ok());
  EXPECT_FALSE(pool_->GetPage(old_page)->used) << "released with the last lease";
  ExpectInvariants();
}

TEST_F(CacheTest, ForkErrors) {
  MakePool(4);
  ASSERT_TRUE(Append("src", 0, 5, 1).ok());
  ASSERT_TRUE(Append("other", 0, 1, 2).ok());
  EXPECT_EQ(pool_->Fork({.target = "other", .source = SequenceRef("src")}).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(pool_->Fork({.target = "t", .source = SequenceRef("src"), .length = 6}).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(pool_->Fork({.target = "t", .source = SequenceRef("nope")}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool_->Fork({.target = "", .source = SequenceRef("src")}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool_->Fork({.target = "src", .source = SequenceRef("src")}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool_->Fork({.target = "t"}).status().code(), absl::StatusCode::kInvalidArgument);
  auto txn = pool_->BeginAppend("src");
  ASSERT_TRUE(txn.ok());
  EXPECT_EQ(pool_->Fork({.target = "t", .source = SequenceRef("src")}).status().code(), absl::StatusCode::kAborted);
  pool_->Abort(**txn);
  // The pool has 1 free page: a fork of 5 tokens needs one (the partial page).
  ASSERT_TRUE(Append("filler", 0, 4, 3).ok());
  auto full = pool_->Fork({.target = "t", .source = SequenceRef("src")});
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
  EXPECT_EQ(pool_->GetSequence("t").status().code(), absl::StatusCode::kNotFound);
  // A last check that fails (the call's deadline passed, the response too
  // large) undoes the fork.
  ForkRequest late{.target = "t", .source = SequenceRef("src"), .length = 4};
  size_t checked_pages = 0;
  late.last_check = [&](size_t pages) {
    checked_pages = pages;
    return absl::DeadlineExceededError("the call's deadline passed");
  };
  const int32_t used = pool_->Snapshot().pages_used;
  EXPECT_EQ(pool_->Fork(late).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(checked_pages, 1u);
  EXPECT_EQ(pool_->GetSequence("t").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool_->Snapshot().pages_used, used);
  EXPECT_EQ(pool_->Snapshot().pages_shared, 0);
  ExpectInvariants();
  EXPECT_TRUE(pool_->Fork({.target = "t", .source = SequenceRef("src"), .length = 4}).ok())
      << "a page-aligned fork needs no page";
  ExpectInvariants();
}

// ---- the prefix index -------------------------------------------------------------

std::vector<std::string> Chain(int n, const std::string& salt = "") {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back(absl::StrCat("h", salt, i));
  return out;
}

// A shared indexed page that a fork truncates into, whose other holder then
// lets go, is held only by a sequence that will write over it in place: it
// leaves the index then (found by the random test of kv_events_test; here
// with no event log attached, as the index must not depend on one).
TEST_F(CacheTest, AnIndexedPageNoHolderHasCompleteLeavesTheIndex) {
  MakePool(16);
  ASSERT_TRUE(Append("a", 0, 8, 1, [](SequenceRowsIn& r) { r.block_hashes = Chain(2); }).ok());
  ASSERT_TRUE(pool_->Fork({.target = "b", .source = SequenceRef("a")}).ok());
  ASSERT_TRUE(pool_->TruncateSequence(SequenceRef("b"), 6).ok());  // b holds page 1 partially, still shared
  EXPECT_EQ(pool_->MatchPrefix(Chain(2))->matched_pages, 2u) << "a still has page 1 complete";
  ASSERT_TRUE(pool_->FreeSequence(SequenceRef("a")).ok());
  EXPECT_EQ(pool_->MatchPrefix(Chain(2))->matched_pages, 1u) << "no holder has page 1 complete any more";
  ASSERT_TRUE(Append("b", 6, 2, 2).ok());  // written in place (no other holder)
  EXPECT_EQ(pool_->MatchPrefix(Chain(2))->matched_pages, 1u);
  auto read = Read(SequenceRef("b"), 8);
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectInvariants();
}

TEST_F(CacheTest, CompletePagesAreIndexedAndForkedByHash) {
  MakePool(16);
  ASSERT_TRUE(Append("a", 0, 10, 1, [](SequenceRowsIn& r) { r.block_hashes = Chain(3); }).ok());
  // Pages 0 and 1 are complete; page 2 (2 tokens) waits.
  auto m = pool_->MatchPrefix(Chain(3));
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->matched_pages, 2u);
  ASSERT_TRUE(Append("a", 10, 2, 2).ok());
  EXPECT_EQ(pool_->MatchPrefix(Chain(3))->matched_pages, 3u) << "indexed once complete";
  EXPECT_EQ(pool_->MatchPrefix(std::vector<std::string>{"h0", "zz", "h2"})->matched_pages, 1u) << "leading pages only";
  auto fork = pool_->Fork({.target = "b", .block_hashes = Chain(5)});
  ASSERT_TRUE(fork.ok()) << fork.status();
  ASSERT_TRUE(fork->sequence.has_value());
  EXPECT_EQ(fork->sequence->length, 12u);
  EXPECT_EQ(fork->pages_shared, 3u);
  model_["b"] = Expected("a", 12);
  EXPECT_EQ(*Read("b", 12), Expected("a", 12));
  auto none = pool_->Fork({.target = "c", .block_hashes = {"zz"}});
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->sequence.has_value());
  EXPECT_EQ(pool_->GetSequence("c").status().code(), absl::StatusCode::kNotFound);
  ExpectInvariants();
}

TEST_F(CacheTest, LayerWiseAppendsIndexAPageWhenEveryLayerIsComplete) {
  MakePool(16);
  ASSERT_TRUE(Append("a", 0, 4, 1, [](SequenceRowsIn& r) { r.block_hashes = {"x"}; }, {0}).ok());
  EXPECT_EQ(pool_->MatchPrefix(std::vector<std::string>{"x"})->matched_pages, 0u);
  ASSERT_TRUE(Append("a", 0, 4, 2, nullptr, {1}).ok());
  EXPECT_EQ(pool_->MatchPrefix(std::vector<std::string>{"x"})->matched_pages, 1u);
}

TEST_F(CacheTest, FreedRewrittenAndTruncatedPagesLeaveTheIndex) {
  MakePool(16);
  ASSERT_TRUE(Append("a", 0, 8, 1, [](SequenceRowsIn& r) { r.block_hashes = Chain(2); }).ok());
  ASSERT_TRUE(Append("a", 0, 1, 2).ok());  // rewrites page 0
  EXPECT_EQ(pool_->MatchPrefix(Chain(2))->matched_pages, 0u);
  EXPECT_EQ(pool_->Snapshot().pages_indexed, 1u);
  ASSERT_TRUE(pool_->TruncateSequence("a", 7).ok());  // page 1 incomplete
  EXPECT_EQ(pool_->Snapshot().pages_indexed, 0u);
  ASSERT_TRUE(Append("b", 0, 4, 3, [](SequenceRowsIn& r) { r.block_hashes = {"y"}; }).ok());
  EXPECT_EQ(pool_->MatchPrefix(std::vector<std::string>{"y"})->matched_pages, 1u);
  ASSERT_TRUE(pool_->FreeSequence("b").ok());
  EXPECT_EQ(pool_->MatchPrefix(std::vector<std::string>{"y"})->matched_pages, 0u);
  EXPECT_EQ(pool_->Snapshot().counters.prefix_queries, 3u);
  ExpectInvariants();
}

TEST_F(CacheTest, APageLeaseKeepsMatchedPagesAfterTheirSequenceIsFreed) {
  MakePool(16);
  ASSERT_TRUE(Append("a", 0, 8, 1, [](SequenceRowsIn& r) { r.block_hashes = Chain(2); }).ok());
  auto m = pool_->MatchPrefix(Chain(2), LeaseRequest{"router"});
  ASSERT_TRUE(m.ok() && m->lease.has_value());
  EXPECT_EQ(m->lease->pages.size(), 2u);
  ASSERT_TRUE(pool_->FreeSequence("a").ok());
  EXPECT_EQ(pool_->MatchPrefix(Chain(2))->matched_pages, 2u) << "still held, still indexed";
  auto fork = pool_->Fork({.target = "b", .block_hashes = Chain(2)});
  ASSERT_TRUE(fork.ok() && fork->sequence.has_value());
  model_["b"] = Expected("a", 8);
  EXPECT_EQ(*Read("b", 8), Expected("a", 8));
  ASSERT_TRUE(pool_->ReleaseLease(m->lease->id).ok());
  EXPECT_EQ(pool_->Snapshot().pages_used, 2);
  ExpectInvariants();
  EXPECT_EQ(pool_->MatchPrefix(std::vector<std::string>{std::string(65, 'x')}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool_->MatchPrefix(std::vector<std::string>{""}).status().code(), absl::StatusCode::kInvalidArgument);
}

// ---- a random interleaving against a reference model ---------------------------------

TEST_F(CacheTest, RandomInterleavingsKeepTheInvariantsAndTheBytes) {
  for (uint32_t seed = 1; seed <= 30; ++seed) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    model_.clear();
    MakePool(24, 4, 2, /*lru=*/seed % 2 == 0);
    std::mt19937 gen(seed);
    struct LeaseModel {
      uint64_t id;
      std::string sequence;
      Layers bytes;  // what the lease protects, as it was when taken
      uint32_t tokens;
      std::vector<int32_t> table;  // the pages holding them, as the reader got them
    };
    std::vector<LeaseModel> leases;
    std::set<std::string> pinned;
    std::map<std::string, int> version;  // content version of each id (hash salt)
    std::map<std::string, Layers> content;  // bytes each hash salt names
    auto id_of = [&](int i) { return absl::StrCat("s", i); };
    for (int step = 0; step < 300; ++step) {
      const std::string id = id_of(gen() % 8);
      const std::string other = id_of(gen() % 8);
      auto live = [&](const std::string& s) { return pool_->GetSequence(s).ok(); };
      switch (gen() % 9) {
        case 0:
        case 1: {  // append at the end, or a rewrite
          const bool was_live = live(id);
          const uint32_t len = was_live ? pool_->GetSequence(id)->length : 0;
          if (!was_live) {
            model_.erase(id);
            ++version[id];  // a new incarnation: new content, new hashes
          }
          const uint32_t start = gen() % 4 == 0 && len > 0 ? gen() % len : len;
          if (start < len) ++version[id];  // rewritten content: the old hashes name the old bytes
          const uint32_t n = 1 + gen() % 9;
          const bool pin = gen() % 10 == 0;
          const std::string salt = absl::StrCat(id, "/", version[id]);
          auto r = Append(id, start, n, gen(), [&](SequenceRowsIn& in) {
            in.pin = pin;
            in.block_hashes = Chain(static_cast<int>((start + n) / 4), salt);
          });
          if (!r.ok()) {
            EXPECT_TRUE(r.status().code() == absl::StatusCode::kResourceExhausted ||
                        r.status().code() == absl::StatusCode::kFailedPrecondition)
                << r.status();
          } else {
            if (pin && !was_live) pinned.insert(id);
            content[salt] = model_[id];  // what the hashes of this version name
          }
          break;
        }
        case 2: {  // fork
          if (!live(id) || live(other) || id == other) break;
          const uint32_t len = pool_->GetSequence(id)->length;
          if (len == 0) break;
          const uint32_t n = 1 + gen() % len;
          auto f = pool_->Fork({.target = other, .source = SequenceRef(id), .length = n});
          if (f.ok()) {
            model_[other] = Expected(id, n);
            ++version[other];
          } else {
            EXPECT_EQ(f.status().code(), absl::StatusCode::kResourceExhausted) << f.status();
          }
          break;
        }
        case 3: {  // free
          if (pool_->FreeSequence(id).ok()) {
            model_.erase(id);
            pinned.erase(id);
          }
          break;
        }
        case 4: {  // truncate
          if (!live(id)) break;
          const uint32_t len = pool_->GetSequence(id)->length;
          const uint32_t to = len == 0 ? 0 : gen() % (len + 1);
          uint32_t protect = 0;
          const uint64_t gen_now = pool_->GetSequence(id)->generation;
          for (const LeaseModel& l : leases) {
            auto ls = pool_->ListLeases(1000, 0);
            for (const LeaseSnapshot& s : ls.leases) {
              if (s.id == l.id && s.sequence == id && s.generation == gen_now) protect = std::max(protect, l.tokens);
            }
          }
          auto t = pool_->TruncateSequence(id, to);
          if (t.ok()) ++version[id];
          if (to < protect) {
            EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
          } else {
            if (t.ok()) {
              for (auto& l : model_[id]) l.resize(std::min<size_t>(l.size(), to));
              if (t->length == 0 && t->kv_indices.empty()) model_.erase(id), pinned.erase(id);
            }
          }
          break;
        }
        case 5: {  // lease
          if (!live(id)) break;
          const uint32_t len = pool_->GetSequence(id)->length;
          auto l = pool_->GetSequence(id, LeaseRequest{"reader", absl::Seconds(1 + gen() % 5)});
          if (l.ok()) {
            std::vector<int32_t> table(l->kv_indices.begin(), l->kv_indices.begin() + (len + 3) / 4);
            leases.push_back({l->lease->id, id, Expected(id, len), len, table});
          }
          break;
        }
        case 6: {  // release
          if (leases.empty()) break;
          const size_t i = gen() % leases.size();
          (void)pool_->ReleaseLease(leases[i].id);
          leases.erase(leases.begin() + i);
          break;
        }
        case 7: {  // time passes
          clock_.now += absl::Seconds(gen() % 3);
          pool_->Maintain();
          break;
        }
        case 8: {  // fork by hash
          if (live(other)) break;
          const std::string salt = absl::StrCat(id, "/", version[id]);
          auto f = pool_->Fork({.target = other, .block_hashes = Chain(3, salt)});
          ASSERT_TRUE(f.ok() || f.status().code() == absl::StatusCode::kResourceExhausted) << f.status();
          if (f.ok() && f->sequence) {
            Layers bytes = content[salt];
            for (auto& l : bytes) l.resize(f->sequence->length);
            model_[other] = bytes;
            ++version[other];
          }
          break;
        }
      }
      ASSERT_TRUE(pool_->CheckInvariants().ok()) << "step " << step << ": " << pool_->CheckInvariants();
      // Every live sequence reads back what the model says (evicted ones leave the model).
      for (auto it = model_.begin(); it != model_.end();) {
        auto s = pool_->GetSequence(it->first);
        if (!s.ok()) {
          ASSERT_EQ(s.status().code(), absl::StatusCode::kNotFound);
          ASSERT_TRUE(absl::StrContains(s.status().message(), "evicted")) << s.status();
          ASSERT_FALSE(pinned.contains(it->first)) << "a pinned sequence was evicted";
          it = model_.erase(it);
          continue;
        }
        auto read = Read(it->first, s->length);
        ASSERT_TRUE(read.ok()) << read.status();
        ASSERT_EQ(*read, Expected(it->first, s->length)) << "step " << step << " sequence " << it->first;
        ++it;
      }
      // Every lease still held reads the bytes it protected when it was taken.
      for (auto it = leases.begin(); it != leases.end();) {
        SequenceRef ref;
        ref.lease_id = it->id;
        auto read = Read(ref, it->tokens);
        if (!read.ok()) {
          ASSERT_EQ(read.status().code(), absl::StatusCode::kNotFound) << read.status();  // expired
          it = leases.erase(it);
          continue;
        }
        ASSERT_EQ(*read, it->bytes) << "step " << step << ": leased bytes changed";
        for (int32_t page : it->table) {
          ASSERT_TRUE(pool_->GetPage(page)->used) << "step " << step << ": a page of a leased table was freed";
        }
        ++it;
      }
    }
    for (const auto& l : leases) (void)pool_->ReleaseLease(l.id);
    leases.clear();
    for (auto& [id, m] : std::map<std::string, Layers>(model_)) ASSERT_TRUE(pool_->FreeSequence(id).ok());
    EXPECT_EQ(pool_->Snapshot().pages_used, 0) << "nothing leaked";
    ASSERT_TRUE(pool_->CheckInvariants().ok());
  }
}

}  // namespace
}  // namespace mlakv::server
