// KV events: the EventLog (numbering, the replay ring, waiting, close, no
// reader ever slowing a recorder) and what a Pool records — a page stored
// once when complete in every layer, with its hash; removed when freed,
// truncated or rewritten into, evicted, or at a lease's end, and why; shared
// pages announced once; and a random workload after which the pages the
// events say are stored are exactly the complete pages some sequence holds.
#include "server/core/kv_events.h"

#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/core/pool.h"
#include "tests/server/core/random_rows.h"

namespace mlakv::server {
namespace {

KvEvent Stored(const std::string& seq) {
  KvEvent e;
  e.kind = KvEvent::Kind::kStored;
  e.sequence = seq;
  return e;
}

std::vector<KvEvent> ReadAll(const EventLog& log, uint64_t from) {
  std::vector<KvEvent> out;
  const absl::Status s = log.Read(from, 1 << 20, absl::ZeroDuration(), &out);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

TEST(EventLogTest, NumbersEventsAndReplaysFromAnyKeptNumber) {
  EventLog log({.replay_capacity = 100});
  EXPECT_EQ(log.next(), 1u);
  EXPECT_EQ(log.oldest(), 0u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(log.Record(Stored(absl::StrCat("s", i))), static_cast<uint64_t>(i + 1));
  const std::vector<KvEvent> from3 = ReadAll(log, 3);
  ASSERT_EQ(from3.size(), 3u);
  for (size_t i = 0; i < from3.size(); ++i) {
    EXPECT_EQ(from3[i].number, 3 + i);
    EXPECT_EQ(from3[i].sequence, absl::StrCat("s", 2 + i));
    EXPECT_GT(from3[i].time_unix_ns, 0);
  }
  EXPECT_TRUE(ReadAll(log, 6).empty()) << "nothing past the last event";
}

TEST(EventLogTest, TheRingDropsTheOldestAndSaysWhatItStillHas) {
  EventLog log({.replay_capacity = 4});
  for (int i = 0; i < 10; ++i) log.Record(Stored("s"));
  EXPECT_EQ(log.oldest(), 7u);
  EXPECT_EQ(log.next(), 11u);
  std::vector<KvEvent> out;
  const absl::Status s = log.Read(3, 100, absl::ZeroDuration(), &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "the oldest is 7")) << s;
  EXPECT_TRUE(out.empty());
  const std::vector<KvEvent> kept = ReadAll(log, 7);
  ASSERT_EQ(kept.size(), 4u);
  EXPECT_EQ(kept.front().number, 7u);
  EXPECT_EQ(kept.back().number, 10u);
}

// An event that lists `pages` pages, each with a 40-byte hash (past any
// string's inline buffer) when `hashed`.
KvEvent Removed(int pages, bool hashed) {
  KvEvent e;
  e.kind = KvEvent::Kind::kRemoved;
  e.sequence = "a-sequence-id-longer-than-sixteen";
  e.reason = "free";
  for (int i = 0; i < pages; ++i) {
    e.pages.push_back(i);
    if (hashed) e.block_hashes.push_back(std::string(40, static_cast<char>('a' + i % 26)));
  }
  return e;
}

TEST(EventLogTest, AnEventsBytesCountItsPagesHashesAndLongStrings) {
  const size_t empty = KvEventBytes(KvEvent{});
  EXPECT_EQ(empty, sizeof(KvEvent));
  const KvEvent pages = Removed(4096, false);
  EXPECT_GE(KvEventBytes(pages), empty + 4096 * sizeof(int32_t) + 34) << "the page list and the long sequence id";
  const KvEvent hashed = Removed(4096, true);
  EXPECT_GE(KvEventBytes(hashed), KvEventBytes(pages) + 4096 * (sizeof(std::string) + 41))
      << "each hash: its string and its heap";
}

// The ring's promise is bounded memory, not only a bounded count: events
// of long sequences (a free of 4,096 pages with their hashes, ~450 KB
// each) are dropped oldest first once the kept bytes would pass
// replay_bytes, though far fewer than replay_capacity are kept; readers
// that resume before the oldest are told so, naming both bounds.
TEST(EventLogTest, TheRingIsBoundedInBytesAsWellAsInEvents) {
  constexpr size_t kBytes = 4 << 20;
  EventLog log({.replay_capacity = 65536, .replay_bytes = kBytes});
  const size_t each = KvEventBytes(Removed(4096, true));
  ASSERT_GT(each, 64u << 10);
  size_t most = 0;
  for (int i = 0; i < 1000; ++i) {
    log.Record(Removed(4096, true));
    most = std::max(most, log.stats().kept_bytes);
  }
  EXPECT_LE(most, kBytes) << "the kept events never held more than replay_bytes";
  EXPECT_GT(log.stats().kept_bytes, kBytes - each) << "and no fewer than fit";
  const uint64_t kept = log.next() - log.oldest();
  EXPECT_EQ(kept, kBytes / each);
  EXPECT_EQ(log.next(), 1001u);
  std::vector<KvEvent> out;
  const absl::Status s = log.Read(1, 10, absl::ZeroDuration(), &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat("at most ", kBytes, " bytes"))) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat("the oldest is ", log.oldest()))) << s;
  const std::vector<KvEvent> all = ReadAll(log, log.oldest());
  ASSERT_EQ(all.size(), kept);
  EXPECT_EQ(all.back().number, 1000u);
  EXPECT_EQ(all.back().pages.size(), 4096u);
}

// The newest event is kept whatever its size (a reader can always have the
// last one), and the next event, small, replaces it.
TEST(EventLogTest, ANewestEventLargerThanTheBoundIsKeptAlone) {
  EventLog log({.replay_capacity = 100, .replay_bytes = 1024});
  log.Record(Stored("small"));
  log.Record(Removed(4096, false));
  EXPECT_EQ(log.oldest(), 2u);
  EXPECT_GT(log.stats().kept_bytes, 1024u);
  ASSERT_EQ(ReadAll(log, 2).size(), 1u);
  log.Record(Stored("next"));
  EXPECT_EQ(log.oldest(), 3u);
  EXPECT_EQ(log.stats().kept_bytes, KvEventBytes(ReadAll(log, 3).at(0)));
}

// A read copies no more events than max_bytes hold (a watcher's copy of
// 4,096 large events would be gigabytes), but always the first.
TEST(EventLogTest, AReadStopsAtItsBytesButAlwaysTakesOneEvent) {
  EventLog log({});
  for (int i = 0; i < 10; ++i) log.Record(Removed(1024, true));
  const size_t each = KvEventBytes(ReadAll(log, 1).at(0));
  std::vector<KvEvent> out;
  ASSERT_TRUE(log.Read(1, 100, absl::ZeroDuration(), &out, 3 * each + each / 2).ok());
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out.back().number, 3u);
  out.clear();
  ASSERT_TRUE(log.Read(4, 100, absl::ZeroDuration(), &out, 1).ok());
  ASSERT_EQ(out.size(), 1u) << "the first event whatever its size";
  EXPECT_EQ(out[0].number, 4u);
  out.clear();
  ASSERT_TRUE(log.Read(5, 2, absl::ZeroDuration(), &out, SIZE_MAX).ok());
  EXPECT_EQ(out.size(), 2u) << "the count still bounds it";
}

TEST(EventLogTest, ReadWaitsForTheNextEventUpToItsTimeoutAndCloseEndsIt) {
  EventLog log({});
  std::vector<KvEvent> out;
  const absl::Time t0 = absl::Now();
  ASSERT_TRUE(log.Read(1, 10, absl::Milliseconds(50), &out).ok());
  EXPECT_TRUE(out.empty());
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(45));
  std::thread recorder([&] {
    absl::SleepFor(absl::Milliseconds(30));
    log.Record(Stored("late"));
  });
  ASSERT_TRUE(log.Read(1, 10, absl::Seconds(10), &out).ok());
  recorder.join();
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].sequence, "late");
  std::thread closer([&] {
    absl::SleepFor(absl::Milliseconds(30));
    log.Close();
  });
  out.clear();
  const absl::Status s = log.Read(2, 10, absl::Seconds(10), &out);
  closer.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

// Recorders on four threads while two readers follow (one of them slow):
// every reader sees consecutive numbers until it falls out of the ring,
// which ends it with OUT_OF_RANGE; the recorders never wait for either.
TEST(EventLogTest, ReadersFollowWithoutGapsAndNeverHoldBackRecorders) {
  EventLog log({.replay_capacity = 64});
  constexpr int kRecorders = 4, kEach = 2000;
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  std::atomic<int> gaps{0}, fell_behind{0};
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      uint64_t cursor = 1;
      while (true) {
        std::vector<KvEvent> out;
        const absl::Status s = log.Read(cursor, 16, absl::Milliseconds(20), &out);
        if (absl::IsOutOfRange(s)) {
          fell_behind.fetch_add(1);
          return;
        }
        for (const KvEvent& e : out) {
          if (e.number != cursor) gaps.fetch_add(1);
          cursor = e.number + 1;
        }
        if (r == 1) absl::SleepFor(absl::Milliseconds(1));  // the slow one
        if (out.empty() && done.load()) return;
      }
    });
  }
  std::vector<std::thread> recorders;
  const absl::Time t0 = absl::Now();
  for (int w = 0; w < kRecorders; ++w) {
    recorders.emplace_back([&] {
      for (int i = 0; i < kEach; ++i) log.Record(Stored("x"));
    });
  }
  for (std::thread& t : recorders) t.join();
  const absl::Duration recording = absl::Now() - t0;
  done.store(true);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(log.next(), static_cast<uint64_t>(kRecorders * kEach + 1));
  EXPECT_EQ(gaps.load(), 0);
  EXPECT_LT(recording, absl::Seconds(5)) << "8,000 records took " << recording;
  EXPECT_LE(fell_behind.load(), 2);
}

// ---- what a pool records ----------------------------------------------------------

constexpr float kCkv = 0.25f, kKpe = 0.5f;

class PoolEventsTest : public ::testing::Test {
 protected:
  void MakePool(int32_t pages, int32_t page_size = 4, int32_t layers = 2, bool lru = false) {
    Pool::Options o;
    o.name = "p";
    o.num_layers = layers;
    o.page_size = page_size;
    o.num_pages = pages;
    o.eviction.lru = lru;
    o.events = log_.get();
    auto pool = Pool::Create(o);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
  }

  // n rows at `start` into `layers` (empty: all), with `hashes` for page
  // table entries from `first_hash`.
  absl::Status Append(const std::string& id, uint32_t start, uint32_t n, std::vector<int32_t> layers = {},
                      std::vector<std::string> hashes = {}, uint32_t first_hash = 0) {
    if (layers.empty()) {
      for (int32_t l = 0; l < pool_->num_layers(); ++l) layers.push_back(l);
    }
    const testing::RowSet rows = testing::MakeRows(n, static_cast<uint32_t>(start * 31 + n), kCkv, kKpe);
    SequenceRowsIn in;
    in.start = start;
    in.row_count = n;
    for (int32_t l : layers) in.layers.push_back(LayerRows::FromBytes(l, rows.ckv, rows.kpe, kCkv, kKpe));
    in.block_hashes = std::move(hashes);
    in.block_hashes_first_page = first_hash;
    auto txn = pool_->BeginAppend(id);
    if (!txn.ok()) return txn.status();
    AppendTransaction* t = txn->get();
    const SequenceRowsIn* r = &in;
    if (absl::Status s = pool_->Stage({&t, 1}, {&r, 1}, DType::kBFloat16); !s.ok()) {
      pool_->Abort(*t);
      return s;
    }
    pool_->Commit(*t);
    return absl::OkStatus();
  }

  // Events recorded since the last call.
  std::vector<KvEvent> New() {
    std::vector<KvEvent> out = ReadAll(*log_, cursor_);
    if (!out.empty()) cursor_ = out.back().number + 1;
    return out;
  }

  std::vector<int32_t> PagesOf(const std::string& id) {
    absl::StatusOr<SequenceSnapshot> s = pool_->GetSequence(SequenceRef(id));
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->kv_indices : std::vector<int32_t>();
  }

  std::unique_ptr<EventLog> log_ = std::make_unique<EventLog>(EventLog::Options{});  // outlives pool_
  uint64_t cursor_ = 1;
  std::unique_ptr<Pool> pool_;
};

TEST_F(PoolEventsTest, APageIsStoredOnceWhenCompleteInEveryLayerWithItsHash) {
  MakePool(16);
  ASSERT_TRUE(Append("s", 0, 6, {0}, {"h0", "h1"}).ok());
  EXPECT_TRUE(New().empty()) << "layer 1 holds nothing yet";
  ASSERT_TRUE(Append("s", 0, 6, {1}).ok());
  std::vector<KvEvent> e = New();
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].kind, KvEvent::Kind::kStored);
  EXPECT_EQ(e[0].pool, "p");
  EXPECT_EQ(e[0].sequence, "s");
  EXPECT_EQ(e[0].first_page_index, 0u);
  EXPECT_EQ(e[0].page_size, 4u);
  const std::vector<int32_t> pages = PagesOf("s");
  EXPECT_EQ(e[0].pages, std::vector<int32_t>{pages[0]});
  EXPECT_EQ(e[0].block_hashes, std::vector<std::string>{"h0"});
  ASSERT_TRUE(Append("s", 6, 2).ok());  // page 1 completes in both layers
  e = New();
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].first_page_index, 1u);
  EXPECT_EQ(e[0].pages, std::vector<int32_t>{pages[1]});
  EXPECT_EQ(e[0].block_hashes, std::vector<std::string>{"h1"});
  ASSERT_TRUE(Append("s", 8, 3).ok());  // a partial page: nothing
  EXPECT_TRUE(New().empty());
  // Freed: one removed event, the stored pages only, with their hashes.
  ASSERT_TRUE(pool_->FreeSequence(SequenceRef("s")).ok());
  e = New();
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].kind, KvEvent::Kind::kRemoved);
  EXPECT_EQ(e[0].reason, "free");
  EXPECT_EQ(e[0].sequence, "s");
  EXPECT_EQ(std::set<int32_t>(e[0].pages.begin(), e[0].pages.end()), (std::set<int32_t>{pages[0], pages[1]}));
  EXPECT_EQ(std::set<std::string>(e[0].block_hashes.begin(), e[0].block_hashes.end()),
            (std::set<std::string>{"h0", "h1"}));
}

TEST_F(PoolEventsTest, ARunOfPagesCarriesAHashListOnlyWhenOneOfThemHasAHash) {
  MakePool(16);
  // Pages 0-3 complete at once: only entry 2 has a hash, so the list holds
  // one per page with empty strings around it.
  ASSERT_TRUE(Append("s", 0, 16, {}, {"h2"}, 2).ok());
  std::vector<KvEvent> e = New();
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].pages, PagesOf("s"));
  EXPECT_EQ(e[0].block_hashes, (std::vector<std::string>{"", "", "h2", ""}));
  // Without hashes: no list at all.
  ASSERT_TRUE(Append("t", 0, 12).ok());
  e = New();
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].pages.size(), 3u);
  EXPECT_TRUE(e[0].block_hashes.empty());
  // A hash on the last page only.
  ASSERT_TRUE(Append("u", 0, 8, {}, {"u1"}, 1).ok());
  e = New();
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].block_hashes, (std::vector<std::string>{"", "u1"}));
}

TEST_F(PoolEventsTest, TruncationAndRewritesWithdrawPagesAndCompletionAnnouncesThemAgain) {
  MakePool(16);
  ASSERT_TRUE(Append("s", 0, 12).ok());
  ASSERT_EQ(New().size(), 1u);  // pages 0-2 in one event
  const std::vector<int32_t> pages = PagesOf("s");
  ASSERT_TRUE(pool_->TruncateSequence(SequenceRef("s"), 6).ok());
  std::vector<KvEvent> e = New();
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].kind, KvEvent::Kind::kRemoved);
  EXPECT_EQ(e[0].reason, "truncate");
  EXPECT_EQ(std::set<int32_t>(e[0].pages.begin(), e[0].pages.end()), (std::set<int32_t>{pages[1], pages[2]}))
      << "the cut partial page and the freed one; page 0 is unchanged";
  ASSERT_TRUE(Append("s", 6, 6).ok());
  e = New();
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].kind, KvEvent::Kind::kStored);
  EXPECT_EQ(e[0].first_page_index, 1u);
  EXPECT_EQ(e[0].pages.size(), 2u);
  // A rewrite of page 0's positions: withdrawn, then announced again.
  ASSERT_TRUE(Append("s", 1, 2).ok());
  e = New();
  ASSERT_EQ(e.size(), 2u);
  EXPECT_EQ(e[0].kind, KvEvent::Kind::kRemoved);
  EXPECT_EQ(e[0].reason, "rewrite");
  EXPECT_EQ(e[0].pages, std::vector<int32_t>{pages[0]});
  EXPECT_EQ(e[1].kind, KvEvent::Kind::kStored);
  EXPECT_EQ(e[1].pages, std::vector<int32_t>{pages[0]});
}

TEST_F(PoolEventsTest, SharedPagesAreAnnouncedOnceAndRemovedWithTheirLastHolder) {
  MakePool(16);
  ASSERT_TRUE(Append("src", 0, 10).ok());
  ASSERT_EQ(New().size(), 1u);
  ForkRequest fork;
  fork.target = "dst";
  fork.source = SequenceRef("src");
  absl::StatusOr<ForkResult> forked = pool_->Fork(fork);
  ASSERT_TRUE(forked.ok()) << forked.status();
  EXPECT_EQ(forked->pages_shared, 2u);
  EXPECT_TRUE(New().empty()) << "the shared pages are already announced; the copied partial one is incomplete";
  ASSERT_TRUE(Append("dst", 10, 2).ok());  // dst's own copy of page 2 completes
  std::vector<KvEvent> e = New();
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].sequence, "dst");
  EXPECT_EQ(e[0].first_page_index, 2u);
  ASSERT_TRUE(pool_->FreeSequence(SequenceRef("src")).ok());
  EXPECT_TRUE(New().empty()) << "dst still holds the shared pages; src's partial page was never stored";
  ASSERT_TRUE(pool_->FreeSequence(SequenceRef("dst")).ok());
  e = New();
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].kind, KvEvent::Kind::kRemoved);
  EXPECT_EQ(e[0].pages.size(), 3u);
}

TEST_F(PoolEventsTest, EvictionAndALeasesEndSayWhyPagesWent) {
  MakePool(4, 4, 2, /*lru=*/true);
  ASSERT_TRUE(Append("old", 0, 8).ok());
  ASSERT_TRUE(Append("new", 0, 12).ok());  // needs 3 of the 2 free pages: "old" is evicted
  std::vector<KvEvent> e = New();
  ASSERT_EQ(e.size(), 3u);
  EXPECT_EQ(e[1].kind, KvEvent::Kind::kRemoved);
  EXPECT_EQ(e[1].reason, "evict");
  EXPECT_EQ(e[1].sequence, "old");
  EXPECT_EQ(e[1].pages.size(), 2u);
  EXPECT_EQ(e[2].kind, KvEvent::Kind::kStored);
  EXPECT_EQ(e[2].sequence, "new");
  absl::StatusOr<LeaseSnapshot> lease = pool_->AcquireLease(SequenceRef("new"), {"reader"});
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(pool_->FreeSequence(SequenceRef("new")).ok());
  EXPECT_TRUE(New().empty()) << "the lease keeps the bytes";
  ASSERT_TRUE(pool_->ReleaseLease(lease->id).ok());
  e = New();
  ASSERT_EQ(e.size(), 1u);
  EXPECT_EQ(e[0].reason, "lease_end");
  EXPECT_EQ(e[0].pages.size(), 3u);
}

// Random appends (some to one layer only), frees, truncations and forks:
// after every step, the pages the event stream says are stored are exactly
// the pages some live sequence holds complete in every layer, and no event
// announces a page twice or removes one it did not announce.
TEST_F(PoolEventsTest, RandomWorkloadTheEventsTrackTheCompletePages) {
  for (uint32_t seed = 1; seed <= 12; ++seed) {
    pool_.reset();  // a fresh pool and log per seed
    log_ = std::make_unique<EventLog>(EventLog::Options{});
    cursor_ = 1;
    MakePool(48, 4, 2);
    std::mt19937 rng(seed);
    std::set<int32_t> announced;
    const std::vector<std::string> ids = {"a", "b", "c", "d", "e"};
    std::string ops;  // what the steps did, for a failure's message
    for (int step = 0; step < 150; ++step) {
      const std::string id = ids[rng() % ids.size()];
      absl::StatusOr<SequenceSnapshot> seq = pool_->GetSequence(SequenceRef(id));
      const uint32_t len0 = seq.ok() ? seq->layer_lengths[0] : 0, len1 = seq.ok() ? seq->layer_lengths[1] : 0;
      switch (rng() % 6) {
        case 0:
        case 1: {  // append to both layers at the end (or rewrite a little before it)
          const uint32_t start = std::min(len0, len1) - (std::min(len0, len1) > 0 && rng() % 4 == 0 ? 1 : 0);
          const uint32_t n = 1 + rng() % 9;
          const absl::Status s = Append(id, start, n);
          absl::StrAppend(&ops, step, ": append ", id, " ", start, "+", n, " ", s.ok() ? "ok" : s.ToString(), "\n");
          break;
        }
        case 2: {  // one layer only
          const uint32_t n = 1 + rng() % 5;
          const absl::Status s = Append(id, len0, n, {0});
          absl::StrAppend(&ops, step, ": append layer 0 ", id, " ", len0, "+", n, " ", s.ok() ? "ok" : s.ToString(), "\n");
          break;
        }
        case 3:
          absl::StrAppend(&ops, step, ": free ", id, " ", pool_->FreeSequence(SequenceRef(id)).status().ToString(), "\n");
          break;
        case 4:
          if (seq.ok()) {
            const uint32_t to = seq->length > 0 ? rng() % seq->length : 0;
            absl::StrAppend(&ops, step, ": truncate ", id, " to ", to, " ",
                            pool_->TruncateSequence(SequenceRef(id), to).status().ToString(), "\n");
          }
          break;
        case 5: {
          ForkRequest fork;
          fork.target = ids[rng() % ids.size()];
          fork.source = SequenceRef(id);
          absl::StrAppend(&ops, step, ": fork ", id, " -> ", fork.target, " ", pool_->Fork(fork).status().ToString(), "\n");
          break;
        }
      }
      for (const KvEvent& e : New()) {
        absl::StrAppend(&ops, "   event ", e.number, e.kind == KvEvent::Kind::kStored ? " stored " : " removed ", e.sequence,
                        " ", e.reason, " [", absl::StrJoin(e.pages, ","), "]\n");
        for (int32_t p : e.pages) {
          if (e.kind == KvEvent::Kind::kStored) {
            EXPECT_TRUE(announced.insert(p).second) << "seed " << seed << " step " << step << ": page " << p << " announced twice";
          } else {
            EXPECT_EQ(announced.erase(p), 1u) << "seed " << seed << " step " << step << ": page " << p << " removed unannounced";
          }
        }
      }
      std::set<int32_t> complete;
      for (const std::string& other : ids) {
        absl::StatusOr<SequenceSnapshot> s = pool_->GetSequence(SequenceRef(other));
        if (!s.ok()) continue;
        for (size_t i = 0; i < s->length / 4 && i < s->kv_indices.size(); ++i) complete.insert(s->kv_indices[i]);
      }
      ASSERT_EQ(announced, complete) << "seed " << seed << " step " << step << "; the steps:\n"
                                     << ops.substr(ops.size() > 30000 ? ops.size() - 30000 : 0);
    }
  }
}

}  // namespace
}  // namespace mlakv::server
