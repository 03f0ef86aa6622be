// CUDA IPC regions end to end (ctest label gpu; skipped without a GPU): a
// separate producer process (cuda_ipc_producer) cudaMallocs, writes rows and
// exports a cudaIpcMemHandle_t (and an interprocess event); the test
// registers it with an in-process server whose pool is on cuda:0 and appends
// from it -- packed rows straight into the kernel, strided rows, an
// AppendBatch over several sequences (device-to-device gather), with and
// without the event -- and the stored bytes equal those of the same rows sent
// as bytes. Refusals: garbage handle bytes, byte_size beyond the allocation,
// a CUDA region named by an append into a cpu pool; the server keeps serving.
// A producer that exits while its region is registered: the server keeps serving.
// (The producer and decode-side processes: tests/server/rpc/ipc_producer_process.h.)
// ExportPool: a decode-side process opens the pool's cache handles and finds
// the bytes ReadSequence returns at the entries GetSequence's page table names.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "tests/server/rpc/ipc_producer_process.h"
#include "tests/server/rpc/region_helpers.h"
#include "tests/server/rpc/service_fixture.h"
#include "tests/testing/vector_files.h"

namespace mlakv::server::testing {
namespace {

class CudaRegionServiceTest : public ::testing::Test, public ServiceFixture {
 protected:
  void SetUp() override {
    if (!mlakv::testing::HaveCuda()) GTEST_SKIP() << "no CUDA device visible";
    set_allow_ipc(true);
    // Pool "default" on cuda:0 and pool "host" on the cpu.
    StartServer("cuda:0", "name: 'default' num_layers: 4 page_size: 16 num_pages: 512",
                "pools { name: 'host' device: 'cpu' num_layers: 2 page_size: 16 num_pages: 8 }");
  }
  void TearDown() override {
    if (IsSkipped()) return;
    for (const auto& p : server().pools()) {
      absl::Status inv = p->CheckInvariants();
      EXPECT_TRUE(inv.ok()) << inv;
    }
    StopServer();
  }

  grpc::Status RegisterCuda(const std::string& name, const std::string& handle, uint64_t bytes,
                            const std::string& event = "") {
    v1::RegisterCudaRegionRequest req;
    req.set_name(name);
    req.set_raw_handle(handle);
    req.set_device_id(0);
    req.set_byte_size(bytes);
    req.set_raw_event_handle(event);
    v1::Region out;
    grpc::ClientContext ctx;
    return stub().RegisterCudaRegion(&ctx, req, &out);
  }

  // The cuda pool alone, on a server whose append_idle_timeout is 1 s: the
  // limit the late-event tests wait into.
  void RestartWithAOneSecondIdleTimeout() {
    StopServer();
    StartServer("cuda:0", "name: 'default' num_layers: 4 page_size: 16 num_pages: 512", "append_idle_timeout_seconds: 1");
  }

  // `late_call` (a call behind a producer's late event) on another thread,
  // and `settle` later an append of `rows` to sequence "other" of the same
  // pool (`before_other` runs just before it): both statuses, the late
  // call's time from its start and the other append's own.
  struct BesideALateCall {
    grpc::Status late, other;
    absl::Duration late_took, other_took;
  };
  BesideALateCall AppendBesideALateCall(const std::function<grpc::Status()>& late_call, const Rows& rows,
                                        absl::Duration settle, const std::function<void()>& before_other = {}) {
    BesideALateCall r;
    const absl::Time t0 = absl::Now();
    std::thread late([&] {
      r.late = late_call();
      r.late_took = absl::Now() - t0;
    });
    absl::SleepFor(settle);
    if (before_other) before_other();
    const absl::Time o0 = absl::Now();
    r.other = AppendRows("other", 0, rows, {2}, kCkvScale, kKpeScale);
    r.other_took = absl::Now() - o0;
    late.join();
    return r;
  }
};

TEST_F(CudaRegionServiceTest, ProducerRowsStoreTheSameBytesAsBytesAppend) {
  // Producer layout: [packed ckv rows][packed kpe rows][strided rows: ckv, kpe, 64 pad].
  const Rows rows = RandomRows(300, 21);
  const ProducerLayout layout = MakeProducerLayout(rows);
  const std::string& bytes = layout.bytes;
  const uint64_t n = rows.n, kpe_off = layout.kpe_off, strided_off = layout.strided_off, stride = layout.stride;
  IpcProducerProcess producer(bytes);
  ASSERT_EQ(producer.mem_handle().size(), 64u);
  ASSERT_TRUE(RegisterCuda("r", producer.mem_handle(), bytes.size()).ok());
  grpc::Status s = RegisterCuda("r-event", producer.mem_handle(), bytes.size(), producer.event_handle());
  // The same allocation opened twice in one process is refused by CUDA on some drivers; only then skip it.
  const bool have_event_region = s.ok();
  if (!s.ok()) std::printf("second open of the same handle: %s\n", Describe(s).c_str());

  s = AppendRows("bytes", 0, rows, {0, 1, 2, 3}, kCkvScale, kKpeScale);
  ASSERT_TRUE(s.ok()) << Describe(s);
  // Packed rows, kernel on the producer's memory.
  s = Append({RegionMessage("packed", 0, n, rows.dtype, {0}, Ref("r", 0), Ref("r", kpe_off))});
  ASSERT_TRUE(s.ok()) << Describe(s);
  ExpectSameStored("packed", "bytes", {0}, n);
  // A few rows a call (one row, the rest of a page, two across a page's
  // end; every layer at once): the backend's kernel reads their placement
  // from its pinned buffer instead of a copy (CudaBackend::ReadsPlacementInPlace);
  // then the rest in one call, copied as before. The same bytes either way.
  for (const auto& [start, count] : std::vector<std::pair<uint64_t, uint64_t>>{{0, 1}, {1, 63}, {64, 2}, {66, n - 66}}) {
    s = Append({RegionMessage("few", static_cast<uint32_t>(start), static_cast<uint32_t>(count), rows.dtype,
                              {0, 1, 2, 3}, Ref("r", start * kCkvRow), Ref("r", kpe_off + start * kKpeRow))});
    ASSERT_TRUE(s.ok()) << "rows [" << start << ", +" << count << "): " << Describe(s);
  }
  ExpectSameStored("few", "bytes", {0, 1, 2, 3}, n);
  // Strided rows.
  s = Append({RegionMessage("strided", 0, n, rows.dtype, {1}, Ref("r", strided_off, stride),
                            Ref("r", strided_off + kCkvRow, stride))});
  ASSERT_TRUE(s.ok()) << Describe(s);
  ExpectSameStored("strided", "bytes", {1}, n);
  if (have_event_region) {
    s = Append({RegionMessage("event", 0, n, rows.dtype, {2}, Ref("r-event", 0), Ref("r-event", kpe_off))});
    ASSERT_TRUE(s.ok()) << Describe(s);
    ExpectSameStored("event", "bytes", {2}, n);
  }
  // AppendBatch: 3 sequences of 100 rows from the region plus one of bytes, layer 3.
  v1::AppendBatchRequest req;
  req.set_dtype(ProtoDType(rows.dtype));
  for (int i = 0; i < 3; ++i) {
    v1::LayerRows* lr = AddBatchLayer(req, "b" + std::to_string(i), 100, 3);
    *lr->mutable_ckv_ref() = Ref("r", i * 100 * kCkvRow);
    *lr->mutable_kpe_ref() = Ref("r", strided_off + i * 100 * stride + kCkvRow, stride);
  }
  v1::AppendBatchResponse bresp;
  {
    grpc::ClientContext ctx;
    s = stub().AppendBatch(&ctx, req, &bresp);
  }
  ASSERT_TRUE(s.ok()) << Describe(s);
  Stored all = Read("bytes", 3, 0, n);
  ASSERT_TRUE(all.status.ok()) << Describe(all.status);
  for (int i = 0; i < 3; ++i) {
    Stored one = Read("b" + std::to_string(i), 3, 0, 100);
    ASSERT_TRUE(one.status.ok()) << Describe(one.status);
    ExpectRowsOf(one.rows, all.rows, i * 100, 100);
  }
  // One row whose stride is 2^63 or more (never stepped: the row's own).
  s = Append({RegionMessage("huge-stride", 0, 1, rows.dtype, {0, 1, 2, 3}, Ref("r", 0, uint64_t{1} << 63),
                            Ref("r", kpe_off, ~uint64_t{0} - 1))});
  ASSERT_TRUE(s.ok()) << Describe(s);
  ExpectSameStored("huge-stride", "bytes", {0, 1, 2, 3}, 1);
  // A cpu pool cannot read a CUDA region.
  s = Append({RegionMessage("cpu", 0, n, rows.dtype, {0}, Ref("r", 0), Ref("r", kpe_off), "host")});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
  // Past the region.
  s = Append({RegionMessage("far", 0, n, rows.dtype, {0}, Ref("r", 8), Ref("r", bytes.size() - n * kKpeRow + 2))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
}

// An Append stream by reference in several messages is written at its end
// (docs/server.md "When an Append stream's CUDA rows are read"): the rows
// held message by message, a layer named again writing what is held first,
// store what the same rows sent as bytes store. A stream that breaks after
// held messages -- a message the server refuses, a client's cancel -- writes
// nothing and keeps no page.
TEST_F(CudaRegionServiceTest, AStreamOfReferencesIsWrittenAtItsEndOrNotAtAll) {
  const Rows rows = RandomRows(300, 23);
  const ProducerLayout layout = MakeProducerLayout(rows);
  const uint64_t n = rows.n, half = n / 2, kpe_off = layout.kpe_off;
  IpcProducerProcess producer(layout.bytes);
  ASSERT_TRUE(RegisterCuda("s", producer.mem_handle(), layout.bytes.size()).ok());
  grpc::Status s = AppendRows("bytes", 0, rows, {0, 1, 2, 3}, kCkvScale, kKpeScale);
  ASSERT_TRUE(s.ok()) << Describe(s);
  // Rows [lo, lo + half) of `layers` from the region's packed copy.
  auto message = [&](const std::string& id, uint64_t lo, const std::vector<uint32_t>& layers,
                     const std::string& region = "s") {
    return RegionMessage(id, static_cast<uint32_t>(lo), static_cast<uint32_t>(half), rows.dtype, layers,
                         Ref(region, lo * kCkvRow), Ref(region, kpe_off + lo * kKpeRow));
  };
  // Layer 0, layers 1-3 (held with it), layer 0 again (the four held go
  // first), layers 1-3 (held with it): written at the end.
  s = Append({message("refs", 0, {0}), message("refs", 0, {1, 2, 3}), message("refs", half, {0}),
              message("refs", half, {1, 2, 3})});
  ASSERT_TRUE(s.ok()) << Describe(s);
  ExpectSameStored("refs", "bytes", {0, 1, 2, 3}, n);
  const uint64_t pages_before = GetPool().pages_used();  // "bytes" and "refs"

  // The third message names a region that is not there: nothing of the two held.
  s = Append({message("refused", 0, {0}), message("refused", 0, {1, 2, 3}), message("refused", half, {0}, "nope")});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(s);
  v1::Sequence seq;
  EXPECT_EQ(GetSequence("refused", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(GetPool().pages_used(), pages_before);

  // The client cancels after two held messages.
  {
    grpc::ClientContext ctx;
    v1::AppendResponse resp;
    auto writer = stub().Append(&ctx, &resp);
    ASSERT_TRUE(writer->Write(message("cancelled", 0, {0})));
    ASSERT_TRUE(writer->Write(message("cancelled", 0, {1, 2, 3})));
    absl::SleepFor(absl::Milliseconds(100));  // both staged (held) on the worker
    ctx.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  absl::Notification drained;
  pool().worker().Post([&] { drained.Notify(); });
  drained.WaitForNotification();
  EXPECT_EQ(GetSequence("cancelled", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(GetPool().pages_used(), pages_before);
  // The rows stored before are untouched.
  ExpectSameStored("refs", "bytes", {0, 1, 2, 3}, n);
}

// A stream by reference whose producer's event completes late -- the GPU
// still computing when the stream ends, as a layer-wise save's does --
// commits once the event has completed, and the pool's worker serves other
// appends meanwhile (server/core/source_waiter.h). An event that does not
// complete within the server's append_idle_timeout_seconds fails the stream
// (DEADLINE_EXCEEDED), and nothing of it is kept.
TEST_F(CudaRegionServiceTest, AStreamWaitsForALateEventOffThePoolsWorker) {
  const Rows rows = RandomRows(300, 29);
  const ProducerLayout layout = MakeProducerLayout(rows);
  const uint64_t n = rows.n, kpe_off = layout.kpe_off;
  IpcProducerProcess producer(layout.bytes);
  ASSERT_TRUE(RegisterCuda("e", producer.mem_handle(), layout.bytes.size(), producer.event_handle()).ok());
  grpc::Status s = AppendRows("bytes", 0, rows, {0, 1}, kCkvScale, kKpeScale);
  ASSERT_TRUE(s.ok()) << Describe(s);
  ASSERT_NO_FATAL_FAILURE(producer.DelayEvent(1500));
  // 200 ms: the stream has ended; its commit waits for the event.
  const BesideALateCall r = AppendBesideALateCall(
      [&] {
        return Append({RegionMessage("late", 0, static_cast<uint32_t>(n), rows.dtype, {0, 1}, Ref("e", 0),
                                     Ref("e", kpe_off))});
      },
      rows, absl::Milliseconds(200));
  EXPECT_TRUE(r.other.ok()) << Describe(r.other);
  EXPECT_TRUE(r.late.ok()) << Describe(r.late);
  EXPECT_LT(r.other_took, absl::Milliseconds(1000)) << "an append to the same pool waited for another stream's event";
  EXPECT_GE(r.late_took, absl::Milliseconds(1400)) << "the stream committed before its producer's event completed";
  ExpectSameStored("late", "bytes", {0, 1}, n);

  // An event still incomplete when the server's append_idle_timeout (1 s here) has passed.
  RestartWithAOneSecondIdleTimeout();
  ASSERT_TRUE(RegisterCuda("e", producer.mem_handle(), layout.bytes.size(), producer.event_handle()).ok());
  ASSERT_NO_FATAL_FAILURE(producer.DelayEvent(3000));
  const absl::Time d0 = absl::Now();
  s = Append({RegionMessage("never", 0, static_cast<uint32_t>(n), rows.dtype, {0}, Ref("e", 0), Ref("e", kpe_off))});
  const absl::Duration took = absl::Now() - d0;
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(s);
  EXPECT_NE(s.error_message().find("append_idle_timeout_seconds"), std::string::npos) << Describe(s);
  EXPECT_GE(took, absl::Milliseconds(900));
  EXPECT_LT(took, absl::Milliseconds(2900)) << "the stream waited for the event past the limit";
  v1::Sequence seq;
  EXPECT_EQ(GetSequence("never", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(GetPool().pages_used(), 0u);
  absl::SleepFor(absl::Milliseconds(2500));  // the event has completed by now: the region serves again
  s = Append({RegionMessage("after", 0, static_cast<uint32_t>(n), rows.dtype, {0}, Ref("e", 0), Ref("e", kpe_off))});
  EXPECT_TRUE(s.ok()) << Describe(s);
}

// A client that cancels while its stream's commit waits for a late producer
// event is noticed at once, not when the event completes or the server's
// append_idle_timeout_seconds (30 s here) pass: the stream is rolled back and
// its pages are free again long before its event completes -- whether the
// pool's worker was spending the wait itself (nothing else queued) or had
// handed it to the pool's SourceWaiter (another append came meanwhile).
TEST_F(CudaRegionServiceTest, ACancelWhileTheCommitWaitsForALateEventRollsBackAtOnce) {
  StopServer();
  StartServer("cuda:0", "name: 'default' num_layers: 4 page_size: 16 num_pages: 512", "append_idle_timeout_seconds: 30");
  const Rows rows = RandomRows(300, 31);
  const ProducerLayout layout = MakeProducerLayout(rows);
  const uint64_t n = rows.n, kpe_off = layout.kpe_off;
  IpcProducerProcess producer(layout.bytes);
  ASSERT_TRUE(RegisterCuda("e", producer.mem_handle(), layout.bytes.size(), producer.event_handle()).ok());
  grpc::Status s = AppendRows("bytes", 0, rows, {0, 1}, kCkvScale, kKpeScale);
  ASSERT_TRUE(s.ok()) << Describe(s);
  const uint64_t pages_before = GetPool().pages_used();
  // Pages back to `pages_before` within `limit` of now (polled).
  auto pages_back_within = [&](absl::Duration limit) {
    const absl::Time until = absl::Now() + limit;
    while (GetPool().pages_used() != pages_before) {
      if (absl::Now() > until) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return true;
  };
  for (const bool other_append_meanwhile : {false, true}) {
    SCOPED_TRACE(other_append_meanwhile ? "the wait handed to the SourceWaiter" : "the worker spending the wait");
    ASSERT_NO_FATAL_FAILURE(producer.DelayEvent(4000));
    const std::string id = other_append_meanwhile ? "cancelled-b" : "cancelled-a";
    grpc::ClientContext ctx;
    v1::AppendResponse resp;
    auto writer = stub().Append(&ctx, &resp);
    ASSERT_TRUE(writer->Write(
        RegionMessage(id, 0, static_cast<uint32_t>(n), rows.dtype, {0, 1}, Ref("e", 0), Ref("e", kpe_off))));
    ASSERT_TRUE(writer->WritesDone());
    absl::SleepFor(absl::Milliseconds(200));  // the stream has ended; its commit waits for the event
    EXPECT_GT(GetPool().pages_used(), pages_before) << "the waiting stream's pages are reserved";
    if (other_append_meanwhile) {
      const absl::Time o0 = absl::Now();
      s = AppendRows("other", 0, rows, {2}, kCkvScale, kKpeScale);
      EXPECT_TRUE(s.ok()) << Describe(s);
      EXPECT_LT(absl::Now() - o0, absl::Milliseconds(1000)) << "the other append waited for the event";
      v1::FreeSequenceRequest free;
      free.set_sequence("other");
      v1::FreeSequenceResponse freed;
      grpc::ClientContext free_ctx;
      s = stub().FreeSequence(&free_ctx, free, &freed);
      ASSERT_TRUE(s.ok()) << Describe(s);
    }
    const absl::Time c0 = absl::Now();
    ctx.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
    EXPECT_TRUE(pages_back_within(absl::Milliseconds(1500)))
        << "the cancelled stream still held its pages " << absl::FormatDuration(absl::Now() - c0)
        << " after the cancel (its event completes 4 s after it was delayed)";
    v1::Sequence seq;
    EXPECT_EQ(GetSequence(id, &seq).error_code(), grpc::StatusCode::NOT_FOUND);
    absl::SleepFor(absl::Milliseconds(4000));  // the delayed event completes before the next round
  }
  ExpectSameStored("bytes", "bytes", {0, 1}, n);
  // The region serves again once the event has completed.
  s = Append({RegionMessage("after", 0, static_cast<uint32_t>(n), rows.dtype, {0, 1}, Ref("e", 0), Ref("e", kpe_off))});
  EXPECT_TRUE(s.ok()) << Describe(s);
  ExpectSameStored("after", "bytes", {0, 1}, n);
}

// A stream that has sent a write for every layer of the pool (a layer-wise
// save's last group) writes them as soon as their producer's event has
// completed, before the stream's end -- waited for on the pool's worker
// while nothing else is queued, by the SourceWaiter once another append
// is -- so that its half-close finds only the commit left. Written early, nothing
// is visible before the commit; a cancel after the write rolls it back with
// every page freed; the commit stores the same bytes as the bytes path.
TEST_F(CudaRegionServiceTest, AStreamWithEveryLayerWritesThemBeforeItsEnd) {
  const Rows rows = RandomRows(300, 41);
  const ProducerLayout layout = MakeProducerLayout(rows);
  const uint32_t n = static_cast<uint32_t>(rows.n);
  const uint64_t kpe_off = layout.kpe_off;
  IpcProducerProcess producer(layout.bytes);
  ASSERT_TRUE(RegisterCuda("e", producer.mem_handle(), layout.bytes.size(), producer.event_handle()).ok());
  grpc::Status s = AppendRows("bytes", 0, rows, {0, 1, 2, 3}, kCkvScale, kKpeScale);
  ASSERT_TRUE(s.ok()) << Describe(s);
  // Polls `ready` every 5 ms for up to `limit`.
  auto within = [](absl::Duration limit, const std::function<bool()>& ready) {
    for (const absl::Time until = absl::Now() + limit; !ready();) {
      if (absl::Now() > until) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return true;
  };
  for (const bool cancel : {false, true}) {
    SCOPED_TRACE(cancel ? "cancelled after the early write" : "committed after the early write");
    const std::string id = cancel ? "early-cancelled" : "early";
    // Per round: the first round's commit keeps its pages.
    const uint64_t pages_before = GetPool().pages_used();
    ASSERT_NO_FATAL_FAILURE(producer.DelayEvent(600));
    grpc::ClientContext ctx;
    v1::AppendResponse resp;
    auto writer = stub().Append(&ctx, &resp);
    ASSERT_TRUE(writer->Write(RegionMessage(id, 0, n, rows.dtype, {0, 1}, Ref("e", 0), Ref("e", kpe_off))));
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_EQ(pool().sources_waiting(), 0u) << "layers 2 and 3 have not come: nothing to write early";
    v1::AppendRequest second = RegionMessage(id, 0, n, rows.dtype, {2, 3}, Ref("e", 0), Ref("e", kpe_off));
    second.clear_pool();
    second.clear_sequence();
    ASSERT_TRUE(writer->Write(second));
    absl::SleepFor(absl::Milliseconds(50));  // the early write waits on the worker, nothing else being queued
    // Another append meanwhile is served at once: the wait moves from the
    // worker to the pool's SourceWaiter.
    const absl::Time o0 = absl::Now();
    s = AppendRows("other", 0, rows, {0}, kCkvScale, kKpeScale);
    EXPECT_TRUE(s.ok()) << Describe(s);
    EXPECT_LT(absl::Now() - o0, absl::Milliseconds(300)) << "another append waited for the early write's event";
    EXPECT_EQ(pool().sources_waiting(), 1u)
        << "every layer held behind a late event: the early write should wait for it off the worker";
    {
      v1::FreeSequenceRequest free;
      free.set_sequence("other");
      v1::FreeSequenceResponse freed;
      grpc::ClientContext free_ctx;
      ASSERT_TRUE(stub().FreeSequence(&free_ctx, free, &freed).ok());
    }
    EXPECT_TRUE(within(absl::Seconds(3), [&] { return pool().sources_waiting() == 0; }))
        << "the event completed 600 ms after it was delayed";
    absl::SleepFor(absl::Milliseconds(50));  // the write, on the worker
    v1::Sequence seq;
    EXPECT_EQ(GetSequence(id, &seq).error_code(), grpc::StatusCode::NOT_FOUND) << "visible before its commit";
    EXPECT_GT(GetPool().pages_used(), pages_before) << "the stream's pages are reserved";
    if (cancel) {
      ctx.TryCancel();
      EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
      EXPECT_TRUE(within(absl::Milliseconds(1500), [&] { return GetPool().pages_used() == pages_before; }))
          << "the cancelled stream's pages were not freed";
      EXPECT_EQ(GetSequence(id, &seq).error_code(), grpc::StatusCode::NOT_FOUND);
    } else {
      ASSERT_TRUE(writer->WritesDone());
      s = writer->Finish();
      ASSERT_TRUE(s.ok()) << Describe(s);
      EXPECT_EQ(resp.rows_written(), 4u * n);
      ExpectSameStored(id, "bytes", {0, 1, 2, 3}, n);
    }
  }
  // Every layer sent and the stream ended at once, its event late (a save
  // whose wait() comes while the GPU still computes): the commit and the
  // early write wait side by side; the commit stores the rows once.
  ASSERT_NO_FATAL_FAILURE(producer.DelayEvent(400));
  s = Append({RegionMessage("ended", 0, n, rows.dtype, {0, 1, 2, 3}, Ref("e", 0), Ref("e", kpe_off))});
  ASSERT_TRUE(s.ok()) << Describe(s);
  ExpectSameStored("ended", "bytes", {0, 1, 2, 3}, n);
  EXPECT_TRUE(within(absl::Seconds(1), [&] { return pool().sources_waiting() == 0; }));
}

// An AppendBatch by reference whose producer's event has not completed
// (a layer-wise save's commit sent while the producer's GPU still computes)
// waits off the pool's worker: another append to the pool is answered
// meanwhile, the batch is written only after its event, and the wait ends
// with a status -- at the server's append_idle_timeout_seconds, at once on a
// cancel -- with nothing written and no page held. A region unregistered
// while its batch waits stays alive for the wait (its event is polled) and
// the batch then fails to find it: NOT_FOUND, nothing written.
TEST_F(CudaRegionServiceTest, ABatchWaitsForALateEventOffThePoolsWorker) {
  RestartWithAOneSecondIdleTimeout();
  const Rows rows = RandomRows(300, 37);
  const ProducerLayout layout = MakeProducerLayout(rows);
  const uint32_t n = static_cast<uint32_t>(rows.n);
  IpcProducerProcess producer(layout.bytes);
  ASSERT_TRUE(RegisterCuda("e", producer.mem_handle(), layout.bytes.size(), producer.event_handle()).ok());
  grpc::Status s = AppendRows("bytes", 0, rows, {0, 1}, kCkvScale, kKpeScale);
  ASSERT_TRUE(s.ok()) << Describe(s);
  const uint64_t pages_before = GetPool().pages_used();
  Pool* pool = nullptr;
  for (const auto& p : server().pools()) {
    if (p->name() == "default") pool = p.get();
  }
  ASSERT_NE(pool, nullptr);
  const auto batch = [&](const std::string& id, const std::string& region) {
    v1::AppendBatchRequest req;
    req.set_dtype(ProtoDType(rows.dtype));
    v1::LayerRows* l0 = AddBatchLayer(req, id, n, 0);  // one sequence, layers 0 and 1
    *l0->mutable_ckv_ref() = Ref(region, 0);
    *l0->mutable_kpe_ref() = Ref(region, layout.kpe_off);
    *req.mutable_sequences(0)->add_layers() = *l0;
    req.mutable_sequences(0)->mutable_layers(1)->set_layer(1);
    return req;
  };
  const auto send = [&](const v1::AppendBatchRequest& req, grpc::ClientContext* ctx) {
    v1::AppendBatchResponse resp;
    return stub().AppendBatch(ctx, req, &resp);
  };

  // Late by 700 ms (under the 1 s limit): answered after its event, the other append at once.
  ASSERT_NO_FATAL_FAILURE(producer.DelayEvent(700));
  const BesideALateCall r = AppendBesideALateCall(
      [&] {
        grpc::ClientContext ctx;
        return send(batch("late", "e"), &ctx);
      },
      rows, absl::Milliseconds(100),
      [&] { EXPECT_EQ(pool->sources_waiting(), 1u) << "the batch's wait is not the pool's SourceWaiter's"; });
  EXPECT_TRUE(r.other.ok()) << Describe(r.other);
  EXPECT_TRUE(r.late.ok()) << Describe(r.late);
  EXPECT_LT(r.other_took, absl::Milliseconds(500)) << "an append to the same pool waited for another batch's event";
  EXPECT_GE(r.late_took, absl::Milliseconds(600)) << "the batch was written before its producer's event completed";
  ExpectSameStored("late", "bytes", {0, 1}, n);
  const uint64_t pages_written = GetPool().pages_used();

  // Still incomplete at append_idle_timeout_seconds: DEADLINE_EXCEEDED, nothing written.
  ASSERT_NO_FATAL_FAILURE(producer.DelayEvent(2500));
  const absl::Time d0 = absl::Now();
  {
    grpc::ClientContext ctx;
    s = send(batch("never", "e"), &ctx);
  }
  const absl::Duration took = absl::Now() - d0;
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(s);
  EXPECT_NE(s.error_message().find("append_idle_timeout_seconds"), std::string::npos) << Describe(s);
  EXPECT_NE(s.error_message().find("nothing was written"), std::string::npos) << Describe(s);
  EXPECT_GE(took, absl::Milliseconds(900));
  EXPECT_LT(took, absl::Milliseconds(2300)) << "the batch waited for the event past the limit";
  v1::Sequence seq;
  EXPECT_EQ(GetSequence("never", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(GetPool().pages_used(), pages_written);
  absl::SleepFor(absl::Milliseconds(1800));  // the delayed event completes

  // A cancel ends the wait at once: no status but CANCELLED, nothing written.
  ASSERT_NO_FATAL_FAILURE(producer.DelayEvent(2500));
  {
    grpc::ClientContext ctx;
    size_t waiting_before_cancel = 0;
    std::thread cancel([&] {
      absl::SleepFor(absl::Milliseconds(150));
      waiting_before_cancel = pool->sources_waiting();
      ctx.TryCancel();
    });
    const absl::Time c0 = absl::Now();
    s = send(batch("cancelled", "e"), &ctx);
    cancel.join();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << Describe(s);
    EXPECT_LT(absl::Now() - c0, absl::Milliseconds(900));
    EXPECT_EQ(waiting_before_cancel, 1u);
  }
  EXPECT_EQ(GetSequence("cancelled", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(pool->sources_waiting(), 0u) << "the cancelled batch's wait went on (its event completes 2.5 s later)";
  EXPECT_EQ(GetPool().pages_used(), pages_written);
  absl::SleepFor(absl::Milliseconds(2300));  // the delayed event completes

  // Unregistered while its batch waits: the wait still ends with the event; then NOT_FOUND.
  ASSERT_TRUE(RegisterCuda("gone", producer.mem_handle(), layout.bytes.size(), producer.event_handle()).ok());
  ASSERT_NO_FATAL_FAILURE(producer.DelayEvent(500));
  grpc::Status gone_status;
  std::thread gone([&] {
    grpc::ClientContext ctx;
    gone_status = send(batch("gone", "gone"), &ctx);
  });
  absl::SleepFor(absl::Milliseconds(100));
  s = Unregister("gone");
  EXPECT_TRUE(s.ok()) << Describe(s);
  gone.join();
  EXPECT_EQ(gone_status.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(gone_status);
  EXPECT_EQ(GetSequence("gone", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(GetPool().pages_used(), pages_written);
  EXPECT_GT(pages_written, pages_before);
}

// A write that reads rows by reference at once, without the service having
// waited for their producer's event first -- an Append stream's message that
// rewrites committed rows cannot be held to the stream's end -- waits in the
// backend at most append_idle_timeout_seconds (1 s here): then the stream
// fails with DEADLINE_EXCEEDED naming the event, nothing of it is written,
// and the pool's worker serves the next append (cudaEventSynchronize there
// would have waited for the event however late).
TEST_F(CudaRegionServiceTest, AWriteBehindAnEventThatNeverCompletesFailsAtTheLimit) {
  RestartWithAOneSecondIdleTimeout();
  const Rows rows = RandomRows(300, 43);
  const Rows other = RandomRows(300, 44);
  const ProducerLayout layout = MakeProducerLayout(other);
  const uint32_t n = static_cast<uint32_t>(rows.n);
  IpcProducerProcess producer(layout.bytes);
  ASSERT_TRUE(RegisterCuda("e", producer.mem_handle(), layout.bytes.size(), producer.event_handle()).ok());
  grpc::Status s = AppendRows("rw", 0, rows, {0, 1}, kCkvScale, kKpeScale);
  ASSERT_TRUE(s.ok()) << Describe(s);
  s = AppendRows("copy", 0, rows, {0, 1}, kCkvScale, kKpeScale);
  ASSERT_TRUE(s.ok()) << Describe(s);
  ASSERT_NO_FATAL_FAILURE(producer.DelayEvent(4000));
  const absl::Time t0 = absl::Now();
  v1::AppendRequest rewrite = RegionMessage("rw", 0, n, other.dtype, {0}, Ref("e", 0), Ref("e", layout.kpe_off));
  rewrite.set_expect_length(n);
  s = Append({rewrite});
  const absl::Duration took = absl::Now() - t0;
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(s);
  EXPECT_NE(s.error_message().find("CUDA event"), std::string::npos) << Describe(s);
  EXPECT_GE(took, absl::Milliseconds(900));
  EXPECT_LT(took, absl::Milliseconds(3500)) << "the write waited for the event past the limit";
  ExpectSameStored("rw", "copy", {0, 1}, n);  // the rewrite left nothing behind
  // The worker is free: another append is answered while the event is still late.
  const absl::Time o0 = absl::Now();
  s = AppendRows("after", 0, rows, {2}, kCkvScale, kKpeScale);
  EXPECT_TRUE(s.ok()) << Describe(s);
  EXPECT_LT(absl::Now() - o0, absl::Milliseconds(1000));
  absl::SleepFor(absl::Milliseconds(3200));  // the delayed event completes: the same rewrite goes through
  s = Append({rewrite});
  EXPECT_TRUE(s.ok()) << Describe(s);
}

// AppendBatch's compact form from one CUDA region range per layer: the rows
// of three sequences lie one after another, so each layer's rows are read in
// place (no gather) and all four layers go in one kernel launch. Layers 0-1
// name the packed copy, layers 2-3 the strided one; every sequence stores
// exactly its slice of the same rows sent as bytes.
TEST_F(CudaRegionServiceTest, CompactBatchFromOneRangePerLayerStoresEachSequencesSlice) {
  const Rows rows = RandomRows(300, 29);
  const ProducerLayout layout = MakeProducerLayout(rows);
  IpcProducerProcess producer(layout.bytes);
  ASSERT_TRUE(RegisterCuda("r", producer.mem_handle(), layout.bytes.size()).ok());
  grpc::Status s = AppendRows("bytes", 0, rows, {0, 1, 2, 3}, kCkvScale, kKpeScale);
  ASSERT_TRUE(s.ok()) << Describe(s);
  const uint32_t counts[] = {100, 150, 50};
  v1::AppendBatchRequest req;
  req.set_dtype(ProtoDType(rows.dtype));
  for (int i = 0; i < 3; ++i) {
    v1::SequenceRows* sr = req.add_sequences();
    sr->set_sequence("c" + std::to_string(i));
    sr->set_row_count(counts[i]);
  }
  for (uint32_t l = 0; l < 4; ++l) {
    v1::LayerRows* lr = req.add_batch_layers();
    lr->set_layer(l);
    if (l < 2) {
      *lr->mutable_ckv_ref() = Ref("r", 0);
      *lr->mutable_kpe_ref() = Ref("r", layout.kpe_off);
    } else {
      *lr->mutable_ckv_ref() = Ref("r", layout.strided_off, layout.stride);
      *lr->mutable_kpe_ref() = Ref("r", layout.strided_off + kCkvRow, layout.stride);
    }
  }
  v1::AppendBatchResponse resp;
  {
    grpc::ClientContext ctx;
    s = stub().AppendBatch(&ctx, req, &resp);
  }
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(resp.rows_written(), 4u * 300);
  for (uint32_t l = 0; l < 4; ++l) {
    Stored all = Read("bytes", l, 0, 300);
    ASSERT_TRUE(all.status.ok()) << Describe(all.status);
    uint64_t first = 0;
    for (int i = 0; i < 3; ++i) {
      Stored one = Read("c" + std::to_string(i), l, 0, counts[i]);
      ASSERT_TRUE(one.status.ok()) << Describe(one.status);
      ExpectRowsOf(one.rows, all.rows, first, counts[i]);
      first += counts[i];
    }
  }
  // A range that ends past the region: OUT_OF_RANGE, nothing written.
  req.mutable_batch_layers(3)->mutable_kpe_ref()->set_offset(layout.bytes.size() - 100 * layout.stride);
  for (int i = 0; i < 3; ++i) req.mutable_sequences(i)->set_sequence("far" + std::to_string(i));
  {
    grpc::ClientContext ctx;
    s = stub().AppendBatch(&ctx, req, &resp);
  }
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  EXPECT_NE(s.error_message().find("batch_layers[3] (layer 3)"), std::string::npos) << s.error_message();
  v1::Sequence seq;
  EXPECT_EQ(GetSequence("far0", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(CudaRegionServiceTest, ExportPoolDecodeSideReadsTheStoredBytes) {
  const Rows rows = RandomRows(40, 23);
  grpc::Status s = AppendRows("dec", 0, rows, {2}, kCkvScale, kKpeScale);
  ASSERT_TRUE(s.ok()) << Describe(s);
  v1::ExportPoolResponse exp;
  {
    grpc::ClientContext ctx;
    s = stub().ExportPool(&ctx, v1::ExportPoolRequest(), &exp);
  }
  ASSERT_TRUE(s.ok()) << Describe(s);
  ASSERT_EQ(exp.layers_size(), 4);
  EXPECT_EQ(exp.device_id(), 0);
  EXPECT_EQ(exp.layers(2).ckv_scale(), kCkvScale);
  v1::Sequence seq;
  ASSERT_TRUE(GetSequence("dec", &seq).ok());
  Stored stored = Read("dec", 2, 0, 40);
  ASSERT_TRUE(stored.status.ok()) << Describe(stored.status);
  for (const v1::ExportedBuffer* buf :
       {&exp.layers(2).ckv_cache(), &exp.layers(2).ckv_sf_cache(), &exp.layers(2).kpe_cache()}) {
    ASSERT_EQ(buf->byte_size(), uint64_t{exp.num_pages()} * exp.page_size() * buf->entry_stride_bytes());
  }
  ASSERT_NO_FATAL_FAILURE(ExpectDecodeSideReads(exp, 2, seq, stored.rows, 40, 0, "dec"));
}

// A decode worker on the same GPU: it leases the sequence with the page
// table it attends from, the sequence is freed and its id reused, other
// sequences are appended into the pool, and a separate process reading the
// leased pages through ExportPool still finds the original bytes. After the
// release, the pages go back to the pool.
TEST_F(CudaRegionServiceTest, ALeaseKeepsTheExportedPagesOfAFreedSequence) {
  const Rows rows = RandomRows(40, 31);
  grpc::Status s = AppendRows("req", 0, rows, {0, 1, 2, 3}, kCkvScale, kKpeScale);
  ASSERT_TRUE(s.ok()) << Describe(s);
  v1::ExportPoolResponse exp;
  {
    grpc::ClientContext ctx;
    s = stub().ExportPool(&ctx, v1::ExportPoolRequest(), &exp);
  }
  ASSERT_TRUE(s.ok()) << Describe(s);
  const Stored stored = Read("req", 1, 0, 40);
  ASSERT_TRUE(stored.status.ok()) << Describe(stored.status);
  v1::Sequence leased;
  {
    v1::GetSequenceRequest req;
    req.set_sequence("req");
    req.mutable_lease()->set_holder("decode-on-gpu0");
    req.mutable_lease()->set_duration_ms(120000);
    grpc::ClientContext ctx;
    s = stub().GetSequence(&ctx, req, &leased);
  }
  ASSERT_TRUE(s.ok()) << Describe(s);
  ASSERT_TRUE(leased.has_lease());
  {
    v1::FreeSequenceRequest req;
    req.set_sequence("req");
    v1::FreeSequenceResponse resp;
    grpc::ClientContext ctx;
    s = stub().FreeSequence(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << Describe(s);
    EXPECT_EQ(resp.leases(), 1u);
  }
  // The id again, and another sequence, appended while the reader attends.
  const Rows other = RandomRows(300, 32);
  ASSERT_TRUE(AppendRows("req", 0, other, {0, 1, 2, 3}, kCkvScale, kKpeScale).ok());
  ASSERT_TRUE(AppendRows("neighbour", 0, other, {0, 1, 2, 3}, kCkvScale, kKpeScale).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectDecodeSideReads(exp, 1, leased, stored.rows, 40, 0, "leased after free"));
  const uint32_t used_before = GetPool().pages_used();
  {
    v1::ReleaseLeaseRequest req;
    req.set_lease_id(leased.lease().lease_id());
    v1::ReleaseLeaseResponse resp;
    grpc::ClientContext ctx;
    s = stub().ReleaseLease(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << Describe(s);
    EXPECT_EQ(resp.pages_freed(), static_cast<uint32_t>(leased.kv_indices_size()));
  }
  EXPECT_EQ(GetPool().pages_used(), used_before - leased.kv_indices_size());
}

TEST_F(CudaRegionServiceTest, ProducerExitingLeavesTheServerServing) {
  const Rows rows = RandomRows(16, 24);
  IpcProducerProcess producer(rows.ckv_bytes() + rows.kpe_bytes());
  ASSERT_EQ(producer.mem_handle().size(), 64u);
  grpc::Status s = RegisterCuda("gone", producer.mem_handle(), producer.allocation_bytes());
  ASSERT_TRUE(s.ok()) << Describe(s);
  producer.Exit();  // cudaFree and exit while the server holds the handle open
  // What the driver does with the opened handle is its business: the append
  // either reads the last contents or fails with a status; it must not take
  // the server down.
  s = Append({RegionMessage("after-exit", 0, rows.n, rows.dtype, {0}, Ref("gone", 0), Ref("gone", rows.n * kCkvRow))});
  std::printf("append from an exited producer's region: %s\n", s.ok() ? "OK" : Describe(s).c_str());
  s = Unregister("gone");
  EXPECT_TRUE(s.ok()) << Describe(s);
  s = AppendRows("still-serving", 0, rows, {1}, kCkvScale, kKpeScale);
  EXPECT_TRUE(s.ok()) << "the server stopped serving after a producer exited: " << Describe(s);
  Stored st = Read("still-serving", 1, 0, rows.n);
  EXPECT_TRUE(st.status.ok()) << Describe(st.status);
}

TEST_F(CudaRegionServiceTest, BadHandlesAreRefusedAndTheServerKeepsServing) {
  const Rows rows = RandomRows(8, 22);
  IpcProducerProcess producer(rows.ckv_bytes() + rows.kpe_bytes());
  ASSERT_EQ(producer.mem_handle().size(), 64u);
  // Garbage handle bytes.
  std::string garbage(64, '\0');
  for (int i = 0; i < 64; ++i) garbage[i] = static_cast<char>(i * 37 + 11);
  grpc::Status s = RegisterCuda("g", garbage, 1024);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  s = RegisterCuda("z", std::string(64, '\0'), 1024);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  // Wrong size of a real handle.
  s = RegisterCuda("short", producer.mem_handle().substr(0, 63), 1024);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  // byte_size beyond the real allocation.
  s = RegisterCuda("big", producer.mem_handle(), producer.allocation_bytes() + 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  // Still serving: a bytes append and a good registration work.
  s = AppendRows("after", 0, rows, {0}, kCkvScale, kKpeScale);
  EXPECT_TRUE(s.ok()) << Describe(s);
  s = RegisterCuda("good", producer.mem_handle(), producer.allocation_bytes());
  EXPECT_TRUE(s.ok()) << Describe(s);
  s = Append({RegionMessage("good", 0, rows.n, rows.dtype, {1}, Ref("good", 0), Ref("good", rows.n * kCkvRow))});
  EXPECT_TRUE(s.ok()) << Describe(s);
}

}  // namespace
}  // namespace mlakv::server::testing
