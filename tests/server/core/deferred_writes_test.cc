// Pool::Stage with `deferred` (AtomicAppend::HoldDeviceWrites, what an Append
// stream uses): rows by reference from device memory are held, message by
// message, and written at Commit in one backend call. What it must keep:
//  * the same bytes stored as when every message is written as it comes;
//  * the caches see the writes in Stage order: a layer named again, rows
//    that cannot be held (host bytes), or a rewrite of committed rows flush
//    what is held first;
//  * nothing written and nothing kept when the append aborts before the
//    flush, fails in it, or fails the last check after it.
//
// There is no GPU here: rows marked as device memory are host bytes standing
// in for a CUDA region's (tests/server/core/stand_in_device_backend.h).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/notification.h"
#include "common/status_macros.h"
#include "server/core/atomic_append.h"
#include "server/core/pool.h"
#include "tests/server/core/random_rows.h"
#include "tests/server/core/stand_in_device_backend.h"
#include "tests/server/core/wrapped_pool.h"

namespace mlakv::server {
namespace {

constexpr float kCkv = 0.25f, kKpe = 0.5f;
constexpr int32_t kLayers = 3, kPageSize = 4;

using testing::StandInDeviceBackend;
using TestPool = testing::WrappedPool<StandInDeviceBackend>;

TestPool MakePool() {
  Pool::Options o;
  o.name = "p";
  o.num_layers = kLayers;
  o.page_size = kPageSize;
  o.num_pages = 32;
  o.layer_scales.assign(kLayers, Pool::Options::Scales{kCkv, kKpe});
  return testing::MakeWrappedPool<StandInDeviceBackend>(o);
}

// `count` rows of `rows` from row `first` of it, at positions start.., for
// the given layers: as device rows (a region's, packed) or host bytes.
SequenceRowsIn Rows(const testing::RowSet& rows, uint32_t first, uint32_t count, uint32_t start,
                    std::vector<int32_t> layers, bool device) {
  SequenceRowsIn r;
  r.start = start;
  r.row_count = count;
  for (int32_t l : layers) {
    LayerRows lr = LayerRows::FromBytes(l, std::string_view(rows.ckv).substr(first * 1024, count * 1024),
                                        std::string_view(rows.kpe).substr(first * 128, count * 128));
    if (device) testing::MarkAsDeviceRows(lr);
    r.layers.push_back(lr);
  }
  return r;
}

absl::Status StageOne(AtomicAppend& a, const SequenceRowsIn& rows) {
  const SequenceRowsIn* ptr = &rows;
  return a.Stage({&ptr, 1}, DType::kBFloat16);
}

absl::Status Ok() { return absl::OkStatus(); }

// An Append stream's transaction on `id` (its device writes held) with `rows` staged.
std::unique_ptr<AtomicAppend> Held(Pool& pool, const std::string& id, const SequenceRowsIn& rows) {
  auto a = std::make_unique<AtomicAppend>(&pool);
  a->HoldDeviceWrites();
  EXPECT_TRUE(a->Begin(id).ok());
  EXPECT_TRUE(StageOne(*a, rows).ok());
  return a;
}

// What sequence `id` stores in `layer`, tokens [0, n), against the CPU
// reference of `rows` from row `first`.
void ExpectStored(Pool& pool, const std::string& id, int32_t layer, uint32_t n, const testing::RowSet& rows,
                  uint32_t first = 0) {
  std::vector<uint8_t> ckv(n * 256), sf(n * 32), kpe(n * 64);
  LayerSnapshot snapshot;
  ASSERT_TRUE(pool.ReadRows(id, layer, 0, n, {ckv.data(), sf.data(), kpe.data()}, &snapshot).ok());
  for (uint32_t r = 0; r < n; ++r) {
    const testing::Entry& want = rows.expected[first + r];
    EXPECT_EQ(std::memcmp(ckv.data() + r * 256, want.data(), 256), 0) << id << " layer " << layer << " row " << r;
    EXPECT_EQ(std::memcmp(sf.data() + r * 32, want.data() + 256, 32), 0) << id << " layer " << layer << " row " << r;
    EXPECT_EQ(std::memcmp(kpe.data() + r * 64, want.data() + 288, 64), 0) << id << " layer " << layer << " row " << r;
  }
}

TEST(DeferredWritesTest, DeviceRowsOfAStreamAreWrittenInOneCallAtCommit) {
  TestPool t = MakePool();
  std::vector<testing::RowSet> rows;
  for (int32_t l = 0; l < kLayers; ++l) rows.push_back(testing::MakeRows(6, 40 + l, kCkv, kKpe));
  std::unique_ptr<AtomicAppend> a = Held(*t.pool, "s", Rows(rows[0], 0, 6, 0, {0}, /*device=*/true));
  for (int32_t l = 1; l < kLayers; ++l) {
    ASSERT_TRUE(StageOne(*a, Rows(rows[l], 0, 6, 0, {l}, /*device=*/true)).ok());
  }
  EXPECT_TRUE(t.backend->calls.empty()) << "nothing written before the commit";
  ASSERT_TRUE(a->Commit(Ok).ok());
  ASSERT_EQ(t.backend->calls.size(), 1u);
  EXPECT_EQ(t.backend->calls[0], (std::vector<int32_t>{0, 1, 2}));
  for (int32_t l = 0; l < kLayers; ++l) ExpectStored(*t.pool, "s", l, 6, rows[l]);
  EXPECT_TRUE(t.pool->CheckInvariants().ok()) << t.pool->CheckInvariants();

  // Without HoldDeviceWrites (AppendBatch, a one-message call) each Stage writes at once.
  AtomicAppend b(t.pool.get());
  ASSERT_TRUE(b.Begin("u").ok());
  ASSERT_TRUE(StageOne(b, Rows(rows[0], 0, 2, 0, {0, 1}, true)).ok());
  EXPECT_EQ(t.backend->calls.size(), 2u);
  ASSERT_TRUE(b.Commit(Ok).ok());
}

TEST(DeferredWritesTest, WritesThatCannotBeHeldFlushWhatIsHeldFirstInStageOrder) {
  TestPool t = MakePool();
  const testing::RowSet x = testing::MakeRows(8, 51, kCkv, kKpe), y = testing::MakeRows(8, 52, kCkv, kKpe);
  std::unique_ptr<AtomicAppend> a = Held(*t.pool, "s", Rows(x, 0, 4, 0, {0, 1}, true));
  ASSERT_TRUE(StageOne(*a, Rows(x, 0, 4, 0, {2}, true)).ok());
  EXPECT_TRUE(t.backend->calls.empty());
  // Layer 0 again (its next rows): the three held layers go first.
  ASSERT_TRUE(StageOne(*a, Rows(x, 4, 4, 4, {0}, true)).ok());
  ASSERT_EQ(t.backend->calls.size(), 1u);
  EXPECT_EQ(t.backend->calls[0], (std::vector<int32_t>{0, 1, 2}));
  // Host bytes are not held: the held layer 0 goes, then these.
  ASSERT_TRUE(StageOne(*a, Rows(y, 4, 4, 4, {1, 2}, false)).ok());
  ASSERT_EQ(t.backend->calls.size(), 3u);
  EXPECT_EQ(t.backend->calls[1], (std::vector<int32_t>{0}));
  EXPECT_EQ(t.backend->calls[2], (std::vector<int32_t>{1, 2}));
  ASSERT_TRUE(a->Commit(Ok).ok());
  EXPECT_EQ(t.backend->calls.size(), 3u) << "nothing was held at the commit";
  ExpectStored(*t.pool, "s", 0, 8, x);
  for (int32_t l : {1, 2}) {
    ExpectStored(*t.pool, "s", l, 4, x);
    std::vector<uint8_t> ckv(4 * 256), sf(4 * 32), kpe(4 * 64);
    LayerSnapshot snapshot;
    ASSERT_TRUE(t.pool->ReadRows("s", l, 4, 4, {ckv.data(), sf.data(), kpe.data()}, &snapshot).ok());
    EXPECT_EQ(std::memcmp(ckv.data(), y.expected[4].data(), 256), 0) << "layer " << l;
  }

  // A stream that rewrites committed rows (its undo is captured) writes at once.
  const testing::RowSet z = testing::MakeRows(2, 53, kCkv, kKpe);
  std::unique_ptr<AtomicAppend> r = Held(*t.pool, "s", Rows(z, 0, 2, 0, {0}, true));
  EXPECT_EQ(t.backend->calls.size(), 4u);
  ASSERT_TRUE(r->Commit(Ok).ok());
  ExpectStored(*t.pool, "s", 0, 2, z);
  EXPECT_TRUE(t.pool->CheckInvariants().ok()) << t.pool->CheckInvariants();
}

TEST(DeferredWritesTest, AnAbortBeforeTheFlushWritesNothingAndReleasesEveryPage) {
  TestPool t = MakePool();
  const testing::RowSet x = testing::MakeRows(9, 61, kCkv, kKpe);
  {
    std::unique_ptr<AtomicAppend> a = Held(*t.pool, "s", Rows(x, 0, 9, 0, {0, 1, 2}, true));
    EXPECT_GT(t.pool->Snapshot().pages_used, 0);
    a->Abort();
  }
  EXPECT_TRUE(t.backend->calls.empty()) << "an aborted stream's held rows are never written";
  EXPECT_EQ(t.pool->Snapshot().pages_used, 0);
  EXPECT_EQ(t.pool->GetSequence("s").status().code(), absl::StatusCode::kNotFound);
  {
    // Destroyed without Commit or Abort (the stream's reactor went away).
    std::unique_ptr<AtomicAppend> a = Held(*t.pool, "s", Rows(x, 0, 9, 0, {1}, true));
  }
  EXPECT_TRUE(t.backend->calls.empty());
  EXPECT_EQ(t.pool->Snapshot().pages_used, 0);
  EXPECT_TRUE(t.pool->CheckInvariants().ok()) << t.pool->CheckInvariants();
}

TEST(DeferredWritesTest, AFailedFlushOrLastCheckCommitsNothing) {
  TestPool t = MakePool();
  const testing::RowSet x = testing::MakeRows(5, 71, kCkv, kKpe);
  // The flush at the commit fails: its status comes back, nothing is kept.
  std::unique_ptr<AtomicAppend> a = Held(*t.pool, "s", Rows(x, 0, 5, 0, {0, 1}, true));
  t.backend->fail_next = true;
  bool checked = false;
  absl::StatusOr<std::vector<SequenceSnapshot>> got = a->Commit([&] {
    checked = true;
    return absl::OkStatus();
  });
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInternal) << got.status();
  EXPECT_NE(got.status().message().find("stand-in device failure"), std::string::npos) << got.status();
  EXPECT_FALSE(checked) << "the last check runs after the rows are written";
  EXPECT_EQ(t.pool->GetSequence("s").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t.pool->Snapshot().pages_used, 0);

  // The flush passes and the last check fails (a deadline passed): aborted.
  std::unique_ptr<AtomicAppend> b = Held(*t.pool, "s", Rows(x, 0, 5, 0, {2}, true));
  got = b->Commit([] { return absl::DeadlineExceededError("too late"); });
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(t.backend->calls.size(), 2u);
  EXPECT_EQ(t.pool->GetSequence("s").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t.pool->Snapshot().pages_used, 0);

  // A flush that fails inside a Stage (layer 0 named again) is that Stage's error.
  std::unique_ptr<AtomicAppend> c = Held(*t.pool, "s", Rows(x, 0, 2, 0, {0}, true));
  t.backend->fail_next = true;
  EXPECT_EQ(StageOne(*c, Rows(x, 2, 3, 2, {0}, true)).code(), absl::StatusCode::kInternal);
  c->Abort();
  EXPECT_EQ(t.pool->Snapshot().pages_used, 0);
  EXPECT_TRUE(t.pool->CheckInvariants().ok()) << t.pool->CheckInvariants();
}

// Once a write is held for every layer of the pool (a layer-wise save's last
// group), the Append stream writes them before its end (WriteHeld) as soon as
// their events have completed: nothing is visible until the commit, which
// then writes nothing; an abort or a failed write afterwards keeps nothing.
TEST(DeferredWritesTest, EveryLayerHeldIsWrittenBeforeTheCommitAndStillRolledBack) {
  TestPool t = MakePool();
  std::vector<testing::RowSet> rows;
  for (int32_t l = 0; l < kLayers; ++l) rows.push_back(testing::MakeRows(7, 90 + l, kCkv, kKpe));
  std::unique_ptr<AtomicAppend> a = Held(*t.pool, "s", Rows(rows[0], 0, 7, 0, {0}, true));
  EXPECT_FALSE(a->holds_every_layer());
  ASSERT_TRUE(StageOne(*a, Rows(rows[1], 0, 7, 0, {1}, true)).ok());
  EXPECT_FALSE(a->holds_every_layer()) << "layer 2 has not come";
  ASSERT_TRUE(StageOne(*a, Rows(rows[2], 0, 7, 0, {2}, true)).ok());
  EXPECT_TRUE(a->holds_every_layer());
  ASSERT_TRUE(a->WriteHeld().ok());
  ASSERT_EQ(t.backend->calls.size(), 1u);
  EXPECT_EQ(t.backend->calls[0], (std::vector<int32_t>{0, 1, 2}));
  EXPECT_FALSE(a->holds_writes());
  EXPECT_FALSE(a->holds_every_layer());
  EXPECT_EQ(t.pool->GetSequence("s").status().code(), absl::StatusCode::kNotFound) << "visible before its commit";
  ASSERT_TRUE(a->Commit(Ok).ok());
  EXPECT_EQ(t.backend->calls.size(), 1u) << "the commit wrote again";
  for (int32_t l = 0; l < kLayers; ++l) ExpectStored(*t.pool, "s", l, 7, rows[l]);
  const int32_t pages_after_s = t.pool->Snapshot().pages_used;

  // Written early, then the stream breaks: rolled back, every page back.
  std::unique_ptr<AtomicAppend> b = Held(*t.pool, "u", Rows(rows[0], 0, 7, 0, {0, 1, 2}, true));
  EXPECT_TRUE(b->holds_every_layer()) << "every layer in one message";
  ASSERT_TRUE(b->WriteHeld().ok());
  EXPECT_GT(t.pool->Snapshot().pages_used, pages_after_s);
  b->Abort();
  EXPECT_EQ(t.pool->GetSequence("u").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t.pool->Snapshot().pages_used, pages_after_s);

  // The early write fails: its status comes back and the append is aborted.
  std::unique_ptr<AtomicAppend> c = Held(*t.pool, "w", Rows(rows[1], 0, 7, 0, {0, 1, 2}, true));
  t.backend->fail_next = true;
  const absl::Status failed = c->WriteHeld();
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  EXPECT_TRUE(c->finished());
  EXPECT_EQ(t.pool->GetSequence("w").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t.pool->Snapshot().pages_used, pages_after_s);

  // A layer named again flushes what is held first: what is held after it
  // is that one layer, not every layer.
  std::unique_ptr<AtomicAppend> d = Held(*t.pool, "x", Rows(rows[0], 0, 3, 0, {0, 1}, true));
  ASSERT_TRUE(StageOne(*d, Rows(rows[0], 3, 4, 3, {1}, true)).ok());
  EXPECT_FALSE(d->holds_every_layer());
  ASSERT_TRUE(StageOne(*d, Rows(rows[2], 0, 7, 0, {2}, true)).ok());
  EXPECT_FALSE(d->holds_every_layer()) << "layer 0 was flushed, not held";
  d->Abort();
  EXPECT_EQ(t.pool->Snapshot().pages_used, pages_after_s);
  EXPECT_TRUE(t.pool->CheckInvariants().ok()) << t.pool->CheckInvariants();
}

// The producers' events held rows are read behind (RowSource::wait_events):
// HeldWaitEvents names each once, and Pool::WhenSourcesComplete hands the
// commit to the pool's SourceWaiter while one has not completed -- the
// worker stays free -- and calls back once it has, or with the query's
// error, or DEADLINE_EXCEEDED.
TEST(DeferredWritesTest, TheCommitWaitsOffTheWorkerForTheHeldRowsEvents) {
  TestPool t = MakePool();
  const testing::RowSet x = testing::MakeRows(4, 81, kCkv, kKpe);
  int producer_a = 0, producer_b = 0;  // their addresses stand in for two IPC events
  SequenceRowsIn rows = Rows(x, 0, 4, 0, {0, 1}, true);
  rows.layers[0].source.wait_events[0] = &producer_a;
  rows.layers[1].source.wait_events[0] = &producer_a;
  rows.layers[1].source.wait_events[1] = &producer_b;
  std::unique_ptr<AtomicAppend> a = Held(*t.pool, "s", rows);
  const std::vector<const void*> events = a->HeldWaitEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0], &producer_a);
  EXPECT_EQ(events[1], &producer_b);

  // Complete already (or none): nothing to wait for.
  EXPECT_FALSE(t.pool->WhenSourcesComplete(events, {}, [](absl::Status) { FAIL(); }));
  EXPECT_FALSE(t.pool->WhenSourcesComplete({}, {}, [](absl::Status) { FAIL(); }));

  // Pending: the callback comes once both have completed, on the waiter's thread.
  {
    absl::MutexLock lock(&t.backend->events_mu);
    t.backend->pending = {&producer_a, &producer_b};
  }
  absl::Notification done;
  absl::Status got = absl::UnknownError("not called");
  ASSERT_TRUE(t.pool->WhenSourcesComplete(events, {}, [&](absl::Status s) {
    got = std::move(s);
    done.Notify();
  }));
  EXPECT_EQ(t.pool->sources_waiting(), 1u);
  // The worker is free meanwhile: another append commits through it.
  absl::Notification other;
  t.pool->worker().Post([&] {
    AtomicAppend b(t.pool.get());
    EXPECT_TRUE(b.Begin("other").ok());
    EXPECT_TRUE(StageOne(b, Rows(x, 0, 2, 0, {2}, false)).ok());
    EXPECT_TRUE(b.Commit(Ok).ok());
    other.Notify();
  });
  EXPECT_TRUE(other.WaitForNotificationWithTimeout(absl::Seconds(10)));
  t.backend->Complete(&producer_a);
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(50))) << "producer b has not completed";
  t.backend->Complete(&producer_b);
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(got.ok()) << got;
  EXPECT_EQ(t.pool->sources_waiting(), 0u);
  ASSERT_TRUE(a->Commit(Ok).ok());
  ExpectStored(*t.pool, "s", 1, 4, x);

  // A query that fails, and a deadline that passes, are the callback's status.
  {
    absl::MutexLock lock(&t.backend->events_mu);
    t.backend->pending = {&producer_a};
    t.backend->failing_event = &producer_b;
  }
  absl::Notification failed, late;
  absl::Status failed_status, late_status;
  ASSERT_TRUE(t.pool->WhenSourcesComplete({&producer_b, &producer_a}, {}, [&](absl::Status s) {
    failed_status = std::move(s);
    failed.Notify();
  }));
  ASSERT_TRUE(t.pool->WhenSourcesComplete({&producer_a}, {.deadline = absl::Now() + absl::Milliseconds(30)}, [&](absl::Status s) {
    late_status = std::move(s);
    late.Notify();
  }));
  ASSERT_TRUE(failed.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(late.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(failed_status.code(), absl::StatusCode::kInternal) << failed_status;
  EXPECT_EQ(late_status.code(), absl::StatusCode::kDeadlineExceeded) << late_status;
  EXPECT_TRUE(t.pool->CheckInvariants().ok()) << t.pool->CheckInvariants();
}

// On the worker, the wait is spent there while nothing else is queued: it
// returns true once the events complete, false as soon as another task is
// queued behind it (the caller then hands the wait over), and fails on a
// failed query or a deadline.
TEST(DeferredWritesTest, TheWorkerWaitsItselfOnlyWhileNothingElseIsQueued) {
  TestPool t = MakePool();
  int producer = 0;
  const std::vector<const void*> events = {&producer};
  auto on_worker = [&](absl::Time deadline, absl::AnyInvocable<void()> meanwhile) {
    absl::StatusOr<bool> got = absl::UnknownError("not run");
    absl::Notification started, done;
    t.pool->worker().Post([&] {
      started.Notify();
      got = t.pool->WaitForSourcesHere(events, {.deadline = deadline});
      done.Notify();
    });
    started.WaitForNotification();
    meanwhile();
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    return got;
  };
  // Complete: at once.
  absl::StatusOr<bool> got = on_worker(absl::InfiniteFuture(), [] {});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(*got);
  // Completing while it waits.
  {
    absl::MutexLock lock(&t.backend->events_mu);
    t.backend->pending = {&producer};
  }
  got = on_worker(absl::InfiniteFuture(), [&] {
    absl::SleepFor(absl::Milliseconds(20));
    t.backend->Complete(&producer);
  });
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(*got);
  // Another task queued behind it: it gives the worker up.
  {
    absl::MutexLock lock(&t.backend->events_mu);
    t.backend->pending = {&producer};
  }
  absl::Notification other_ran;
  got = on_worker(absl::InfiniteFuture(), [&] { t.pool->worker().Post([&] { other_ran.Notify(); }); });
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_FALSE(*got);
  EXPECT_TRUE(other_ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  // Still pending at the deadline; a failed query.
  got = on_worker(absl::Now() + absl::Milliseconds(30), [] {});
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << got.status();
  {
    absl::MutexLock lock(&t.backend->events_mu);
    t.backend->failing_event = &producer;
  }
  got = on_worker(absl::InfiniteFuture(), [] {});
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInternal) << got.status();
}

// Many commits waiting at once, their events completing from another thread
// in a shuffled order: each is called back exactly once, with OK.
TEST(DeferredWritesTest, ManyWaitsEachCalledBackOnce) {
  TestPool t = MakePool();
  constexpr int kWaits = 200;
  std::vector<int> producers(kWaits);
  {
    absl::MutexLock lock(&t.backend->events_mu);
    for (int& p : producers) t.backend->pending.insert(&p);
  }
  std::vector<std::atomic<int>> calls(kWaits);
  std::atomic<int> not_ok{0};
  absl::BlockingCounter all(kWaits);
  for (int i = 0; i < kWaits; ++i) {
    ASSERT_TRUE(t.pool->WhenSourcesComplete({&producers[i]}, {}, [&, i](absl::Status s) {
      if (!s.ok()) not_ok.fetch_add(1);
      calls[i].fetch_add(1);
      all.DecrementCount();
    }));
  }
  std::vector<int> order(kWaits);
  for (int i = 0; i < kWaits; ++i) order[i] = (i * 73) % kWaits;  // 73 is prime to 200: a permutation
  std::thread completer([&] {
    for (int i : order) t.backend->Complete(&producers[i]);
  });
  all.Wait();
  completer.join();
  EXPECT_EQ(not_ok.load(), 0);
  for (int i = 0; i < kWaits; ++i) EXPECT_EQ(calls[i].load(), 1) << "wait " << i;
  EXPECT_EQ(t.pool->sources_waiting(), 0u);
}

// A caller that gives the wait up (its client cancelled the Append) ends it
// with CANCELLED as soon as the wait polls, not at the deadline -- on the
// waiter's thread and on the worker -- and only its own wait: another
// commit waiting on the same event still completes with OK.
TEST(DeferredWritesTest, AnAbandonedWaitEndsAtOnceWithCancelled) {
  TestPool t = MakePool();
  int producer = 0;
  {
    absl::MutexLock lock(&t.backend->events_mu);
    t.backend->pending = {&producer};
  }
  std::atomic<bool> cancelled{false};
  const WaitLimits abandonable{.deadline = absl::InfiniteFuture(), .abandoned = [&] { return cancelled.load(); }};
  absl::Notification abandoned_done, kept_done;
  absl::Status abandoned_status, kept_status;
  ASSERT_TRUE(t.pool->WhenSourcesComplete({&producer}, abandonable, [&](absl::Status s) {
    abandoned_status = std::move(s);
    abandoned_done.Notify();
  }));
  ASSERT_TRUE(t.pool->WhenSourcesComplete({&producer}, {}, [&](absl::Status s) {
    kept_status = std::move(s);
    kept_done.Notify();
  }));
  EXPECT_FALSE(abandoned_done.WaitForNotificationWithTimeout(absl::Milliseconds(30))) << "nothing ended it yet";
  EXPECT_EQ(t.pool->sources_waiting(), 2u);
  cancelled = true;
  ASSERT_TRUE(abandoned_done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(abandoned_status.code(), absl::StatusCode::kCancelled) << abandoned_status;
  EXPECT_FALSE(kept_done.HasBeenNotified()) << "the other wait is not abandoned";
  EXPECT_EQ(t.pool->sources_waiting(), 1u);
  t.backend->Complete(&producer);
  ASSERT_TRUE(kept_done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(kept_status.ok()) << kept_status;

  // On the worker: the spinning wait returns CANCELLED once abandoned.
  {
    absl::MutexLock lock(&t.backend->events_mu);
    t.backend->pending = {&producer};
  }
  cancelled = false;
  absl::StatusOr<bool> got = absl::UnknownError("not run");
  absl::Notification started, done;
  t.pool->worker().Post([&] {
    started.Notify();
    got = t.pool->WaitForSourcesHere(std::vector<const void*>{&producer}, abandonable);
    done.Notify();
  });
  started.WaitForNotification();
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(30))) << "nothing ended it yet";
  cancelled = true;
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kCancelled) << got.status();
}

// A pool destroyed while a commit waits calls it back with CANCELLED (its
// reactor then rolls back); nothing is left waiting.
TEST(DeferredWritesTest, APoolThatGoesCancelsWhatWaits) {
  TestPool t = MakePool();
  int producer = 0;
  {
    absl::MutexLock lock(&t.backend->events_mu);
    t.backend->pending = {&producer};
  }
  absl::Status got;
  bool called = false;
  ASSERT_TRUE(t.pool->WhenSourcesComplete({&producer}, {}, [&](absl::Status s) {
    got = std::move(s);
    called = true;
  }));
  t.pool.reset();
  EXPECT_TRUE(called);
  EXPECT_EQ(got.code(), absl::StatusCode::kCancelled) << got;
}


}  // namespace
}  // namespace mlakv::server
