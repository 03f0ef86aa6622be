// WatchEvents end to end over an in-process server: "all cleared" first,
// then stored/removed events of a known workload with their hashes and the
// server's id, numbers without gaps; a watcher resuming by number gets what
// it missed; numbers outside what the server has are OUT_OF_RANGE; a
// watcher that stops reading is ended with RESOURCE_EXHAUSTED while the
// appends go on at full speed; draining ends every stream with UNAVAILABLE;
// the watcher limit. Under TSan (label tsan) the watcher threads too.
#include <gtest/gtest.h>

#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/server/rpc/service_fixture.h"

namespace mlakv::server::testing {
namespace {

class WatchEventsTest : public ::testing::Test, public ServiceFixture {
 protected:
  void SetUp() override { StartServer("cpu", "name: 'default' num_layers: 2 page_size: 4 num_pages: 256"); }

  // Events from `from` until `count` arrived (or the stream ended).
  struct Watched {
    std::vector<v1::KvEvent> events;
    std::string server_id;
    grpc::Status status;
  };
  Watched Watch(uint64_t from, size_t count, uint32_t max_batch = 0) {
    Watched w;
    grpc::ClientContext ctx;
    v1::WatchEventsRequest req;
    req.set_from(from);
    req.set_max_batch(max_batch);
    auto reader = stub().WatchEvents(&ctx, req);
    v1::WatchEventsResponse resp;
    while (w.events.size() < count && reader->Read(&resp)) {
      w.server_id = resp.server_id();
      for (const v1::KvEvent& e : resp.events()) w.events.push_back(e);
    }
    if (w.events.size() >= count) ctx.TryCancel();
    w.status = reader->Finish();
    return w;
  }

  void AppendPages(const std::string& id, int pages, const std::vector<std::string>& hashes = {}) {
    v1::AppendRequest m = AppendMessage(id, 0, RandomRows(4 * pages, 7), 0, 4 * pages, {0, 1}, 0.25f, 0.5f);
    for (const std::string& h : hashes) m.add_block_hashes(h);
    const grpc::Status s = ServiceFixture::Append({m});
    ASSERT_TRUE(s.ok()) << Describe(s);
  }
};

TEST_F(WatchEventsTest, AKnownWorkloadArrivesInOrderWithHashesAndTheServersId) {
  AppendPages("a", 3, {"ha0", "ha1", "ha2"});
  AppendPages("b", 2);
  Free("a");
  Watched w = Watch(1, 4);
  ASSERT_EQ(w.events.size(), 4u) << Describe(w.status);
  EXPECT_EQ(w.server_id, "test-server");
  for (size_t i = 0; i < w.events.size(); ++i) EXPECT_EQ(w.events[i].number(), i + 1) << "numbers without gaps";
  EXPECT_TRUE(w.events[0].has_cleared()) << "a server's first event: all cleared";
  ASSERT_TRUE(w.events[1].has_stored());
  EXPECT_EQ(w.events[1].pool(), "default");
  EXPECT_EQ(w.events[1].stored().sequence(), "a");
  EXPECT_EQ(w.events[1].stored().pages_size(), 3);
  EXPECT_EQ(w.events[1].stored().page_size(), 4u);
  ASSERT_EQ(w.events[1].stored().block_hashes_size(), 3);
  EXPECT_EQ(w.events[1].stored().block_hashes(2), "ha2");
  ASSERT_TRUE(w.events[2].has_stored());
  EXPECT_EQ(w.events[2].stored().block_hashes_size(), 0) << "no hashes given: none sent";
  ASSERT_TRUE(w.events[3].has_removed());
  EXPECT_EQ(w.events[3].removed().sequence(), "a");
  EXPECT_EQ(w.events[3].removed().reason(), "free");
  EXPECT_EQ(w.events[3].removed().pages_size(), 3);
  EXPECT_EQ(w.events[3].removed().block_hashes(0), "ha0");
  // Resuming from 3 replays 3 and 4; a live watcher (from 0) sees only new ones.
  Watched resumed = Watch(3, 2);
  ASSERT_EQ(resumed.events.size(), 2u);
  EXPECT_EQ(resumed.events[0].number(), 3u);
  std::thread later([this] {
    absl::SleepFor(absl::Milliseconds(100));
    AppendPages("c", 1);
  });
  Watched live = Watch(0, 1);
  later.join();
  ASSERT_EQ(live.events.size(), 1u);
  EXPECT_EQ(live.events[0].number(), 5u);
  EXPECT_EQ(live.events[0].stored().sequence(), "c");
}

TEST_F(WatchEventsTest, NumbersTheServerDoesNotHaveAreOutOfRange) {
  StopServer();
  StartServer("cpu", "name: 'default' num_layers: 2 page_size: 4 num_pages: 256", "events { replay_capacity: 4 }");
  for (int i = 0; i < 6; ++i) AppendPages(absl::StrCat("s", i), 1);  // events 1..7; kept: 4..7
  Watched old = Watch(2, 1);
  EXPECT_EQ(old.status.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(old.status);
  EXPECT_TRUE(absl::StrContains(old.status.error_message(), "the oldest is 4")) << old.status.error_message();
  Watched future = Watch(99, 1);
  EXPECT_EQ(future.status.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(future.status);
  EXPECT_TRUE(absl::StrContains(future.status.error_message(), "4..7")) << future.status.error_message();
  Watched kept = Watch(4, 4);
  ASSERT_EQ(kept.events.size(), 4u) << Describe(kept.status);
  EXPECT_EQ(kept.events.back().number(), 7u);
}

// events { replay_bytes } bounds what the server keeps by size: events of
// long hashed sequences (~16 KB each here) leave the buffer long before
// replay_capacity (65,536 by default) is reached, and a watcher resuming
// before the oldest is told both bounds and where to resume.
TEST_F(WatchEventsTest, TheReplayBufferIsBoundedInBytes) {
  StopServer();
  StartServer("cpu", "name: 'default' num_layers: 2 page_size: 4 num_pages: 256", "events { replay_bytes: 40000 }");
  std::vector<std::string> hashes;
  for (int i = 0; i < 200; ++i) hashes.push_back(absl::StrCat(std::string(36, 'h'), 1000 + i));  // 40 bytes
  for (int round = 0; round < 5; ++round) {
    AppendPages("long", 200, hashes);
    Free("long");
  }  // events 1 (cleared) .. 11
  Watched old = Watch(1, 1);
  EXPECT_EQ(old.status.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(old.status);
  EXPECT_TRUE(absl::StrContains(old.status.error_message(), "at most 40000 bytes")) << old.status.error_message();
  // Two events of ~16 KB fit in 40,000 bytes, three do not.
  Watched kept = Watch(10, 2);
  ASSERT_EQ(kept.events.size(), 2u) << Describe(kept.status);
  EXPECT_EQ(kept.events[0].number(), 10u);
  ASSERT_TRUE(kept.events[0].has_stored());
  EXPECT_EQ(kept.events[0].stored().block_hashes_size(), 200);
  ASSERT_TRUE(kept.events[1].has_removed());
  EXPECT_EQ(kept.events[1].removed().pages_size(), 200);
  Watched gone = Watch(9, 1);
  EXPECT_EQ(gone.status.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(gone.status);
  EXPECT_TRUE(absl::StrContains(gone.status.error_message(), "the oldest is 10")) << gone.status.error_message();
}

// Events of long hashed sequences (1,024 pages with 64-byte hashes: ~70 KB
// each) read in one batch of 256 would make a response of ~6 MB: past the
// 4 MB a gRPC client (or grpcurl) accepts by default, so such a watcher
// failed at the same event every time it resumed. Responses stop short of
// ~1 MiB; a client with gRPC's default limits gets every event, in order.
TEST_F(WatchEventsTest, LargeEventsComeInResponsesAClientWithDefaultLimitsAccepts) {
  StopServer();
  StartServer("cpu", "name: 'default' num_layers: 1 page_size: 1 num_pages: 2048", "", "127.0.0.1:0");
  std::vector<std::string> hashes;
  for (int i = 0; i < 1024; ++i) hashes.push_back(absl::StrCat(std::string(56, 'h'), 10000000 + i));  // 64 bytes
  for (int round = 0; round < 40; ++round) {
    v1::AppendRequest m = AppendMessage("long", 0, RandomRows(1024, round), 0, 1024, {0}, 0.25f, 0.5f);
    for (const std::string& h : hashes) m.add_block_hashes(h);
    const grpc::Status s = ServiceFixture::Append({m});
    ASSERT_TRUE(s.ok()) << Describe(s);
    Free("long");
  }  // events 1 (cleared) .. 81
  auto channel = grpc::CreateChannel(server().bound_address(), grpc::InsecureChannelCredentials());  // default limits
  auto plain = v1::KvCache::NewStub(channel);
  grpc::ClientContext ctx;
  v1::WatchEventsRequest req;
  req.set_from(1);
  auto reader = plain->WatchEvents(&ctx, req);
  v1::WatchEventsResponse resp;
  uint64_t last = 0;
  int responses = 0;
  size_t largest = 0;
  while (last < 81 && reader->Read(&resp)) {
    ++responses;
    largest = std::max(largest, resp.ByteSizeLong());
    for (const v1::KvEvent& e : resp.events()) {
      EXPECT_EQ(e.number(), last + 1) << "no gap";
      last = e.number();
      if (e.has_stored()) {
        EXPECT_EQ(e.stored().block_hashes_size(), 1024);
      }
    }
  }
  ctx.TryCancel();
  const grpc::Status end = reader->Finish();
  EXPECT_EQ(last, 81u) << "every event arrived; the stream ended with " << Describe(end);
  EXPECT_GE(responses, 5) << "~5.7 MB of events in responses of ~1 MiB";
  EXPECT_LE(largest, (size_t{1} << 20) + (100 << 10)) << "a response holds no more than ~1 MiB and one event";
}

// A server whose send limit is below the 1 MiB a response may hold sizes
// its responses to that limit (it sent ~116 KB batches to a 64 KB limit,
// failing at the same event on every resume); one event alone over it ends
// the watch with a status that says what to do.
TEST_F(WatchEventsTest, ResponsesStayWithinTheServersOwnSendLimit) {
  StopServer();
  StartServer("cpu", "name: 'default' num_layers: 1 page_size: 1 num_pages: 32768", "max_message_bytes: 65536",
              "127.0.0.1:0");
  for (int i = 0; i < 200; ++i) {  // events 2..201, ~580 bytes each: ~116 KB of them
    v1::AppendRequest m = AppendMessage(absl::StrCat("s", i), 0, RandomRows(8, i), 0, 8, {0}, 0.25f, 0.5f);
    for (int h = 0; h < 8; ++h) m.add_block_hashes(absl::StrCat(std::string(56, 'h'), 10000000 + i * 8 + h));
    ASSERT_TRUE(ServiceFixture::Append({m}).ok());
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::WatchEventsRequest req;
  req.set_from(1);
  auto reader = stub().WatchEvents(&ctx, req);
  v1::WatchEventsResponse resp;
  uint64_t last = 0;
  int responses = 0;
  while (last < 201 && reader->Read(&resp)) {
    ++responses;
    EXPECT_LE(resp.ByteSizeLong(), 65536u);
    for (const v1::KvEvent& e : resp.events()) last = e.number();
  }
  ctx.TryCancel();
  const grpc::Status end = reader->Finish();
  EXPECT_EQ(last, 201u) << Describe(end);
  EXPECT_GE(responses, 2);
  // One event alone over the limit: 30,000 pages stored by one append (in
  // messages under the limit), ~74 KB of page ids.
  const Rows rows = RandomRows(30000, 7);
  std::vector<v1::AppendRequest> messages;
  for (int i = 0; i < 30000; i += 50) {
    messages.push_back(AppendMessage(i == 0 ? "long" : "", i, rows, i, 50, {0}));
    if (i == 0) messages.back().set_view(v1::SEQUENCE_VIEW_LENGTHS);
  }
  const grpc::Status appended = ServiceFixture::Append(messages);  // event 202
  ASSERT_TRUE(appended.ok()) << Describe(appended);
  grpc::ClientContext ctx2;
  ctx2.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  req.set_from(202);
  auto big = stub().WatchEvents(&ctx2, req);
  while (big->Read(&resp)) {
  }
  const grpc::Status refused = big->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << Describe(refused);
  EXPECT_TRUE(absl::StrContains(refused.error_message(), "event 202 takes")) << Describe(refused);
  EXPECT_TRUE(absl::StrContains(refused.error_message(), "from=203")) << Describe(refused);
}

// A watcher that stops reading: the server's writes stall on flow control,
// its next event leaves the ring, and it is ended with RESOURCE_EXHAUSTED
// naming that event; the appends meanwhile run as fast as without it.
TEST_F(WatchEventsTest, AWatcherThatFallsBehindIsEndedAndNeverSlowsAppends) {
  StopServer();
  StartServer("cpu", "name: 'default' num_layers: 1 page_size: 1 num_pages: 8192", "events { replay_capacity: 32 }");
  grpc::ClientContext ctx;
  v1::WatchEventsRequest req;
  req.set_from(1);
  req.set_max_batch(1);  // one event per message: the HTTP/2 window fills after a few hundred
  auto reader = stub().WatchEvents(&ctx, req);
  v1::WatchEventsResponse resp;
  ASSERT_TRUE(reader->Read(&resp));  // the stream is up
  const std::string long_id(900, 'x');  // ~1 KB per event
  const absl::Time t0 = absl::Now();
  for (int i = 0; i < 600; ++i) {
    v1::AppendRequest m = AppendMessage(long_id + std::to_string(i), 0, RandomRows(1, i), 0, 1, {0}, 0.25f, 0.5f);
    const grpc::Status s = ServiceFixture::Append({m});
    ASSERT_TRUE(s.ok()) << Describe(s);
  }
  const absl::Duration appending = absl::Now() - t0;
  uint64_t last = resp.events(0).number();
  int read = 1;
  while (reader->Read(&resp)) {
    for (const v1::KvEvent& e : resp.events()) {
      EXPECT_EQ(e.number(), last + 1) << "no gap before the end";
      last = e.number();
      ++read;
    }
  }
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "fell behind")) << s.error_message();
  EXPECT_LT(read, 601) << "it cannot have seen every event";
  EXPECT_LT(appending, absl::Seconds(30));
}

TEST_F(WatchEventsTest, DrainingEndsStreamsAndNewOnesAreRefused) {
  grpc::ClientContext ctx;
  v1::WatchEventsRequest req;
  auto reader = stub().WatchEvents(&ctx, req);  // live only: nothing to read yet
  std::thread stopper([this] {
    absl::SleepFor(absl::Milliseconds(100));
    server().Shutdown(absl::Seconds(5));
  });
  v1::WatchEventsResponse resp;
  while (reader->Read(&resp)) {
  }
  const grpc::Status s = reader->Finish();
  stopper.join();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << Describe(s);
}

// Server identity (a client routing over a fleet records where a sequence
// lives from any response): GetPool, ListPools and every response that
// describes a sequence carry --server_id.
TEST_F(WatchEventsTest, EveryPoolAndSequenceResponseNamesTheServer) {
  v1::AppendResponse appended;
  ASSERT_TRUE(ServiceFixture::Append({AppendMessage("id", 0, RandomRows(3, 1), 0, 3, {0, 1}, 0.25f, 0.5f)}, &appended).ok());
  EXPECT_EQ(appended.sequence().server_id(), "test-server");
  EXPECT_EQ(GetPool().server_id(), "test-server");
  v1::Sequence seq;
  ASSERT_TRUE(GetSequence("id", &seq).ok());
  EXPECT_EQ(seq.server_id(), "test-server");
  {
    grpc::ClientContext ctx;
    v1::ListPoolsResponse pools;
    ASSERT_TRUE(stub().ListPools(&ctx, v1::ListPoolsRequest(), &pools).ok());
    EXPECT_EQ(pools.pools(0).server_id(), "test-server");
  }
  {
    grpc::ClientContext ctx;
    v1::AppendBatchRequest req;
    req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
    v1::SequenceRows* sr = req.add_sequences();
    sr->set_sequence("id");
    sr->set_start(3);
    v1::AppendBatchResponse resp;
    ASSERT_TRUE(stub().AppendBatch(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.sequences(0).server_id(), "test-server");
  }
  {
    grpc::ClientContext ctx;
    v1::TruncateSequenceRequest req;
    req.set_sequence("id");
    req.set_length(1);
    v1::Sequence out;
    ASSERT_TRUE(stub().TruncateSequence(&ctx, req, &out).ok());
    EXPECT_EQ(out.server_id(), "test-server");
  }
  {
    grpc::ClientContext ctx;
    v1::ForkSequenceRequest req;
    req.set_source("id");
    req.set_target("copy");
    v1::ForkSequenceResponse out;
    ASSERT_TRUE(stub().ForkSequence(&ctx, req, &out).ok());
    EXPECT_EQ(out.sequence().server_id(), "test-server");
  }
  {
    grpc::ClientContext ctx;
    v1::ListSequencesRequest req;
    v1::ListSequencesResponse out;
    ASSERT_TRUE(stub().ListSequences(&ctx, req, &out).ok());
    EXPECT_EQ(out.server_id(), "test-server");
  }
}

TEST_F(WatchEventsTest, TheWatcherLimitIsEnforced) {
  StopServer();
  StartServer("cpu", "name: 'default' num_layers: 1 page_size: 4 num_pages: 16", "events { max_watchers: 1 }");
  grpc::ClientContext first_ctx;
  auto first = stub().WatchEvents(&first_ctx, v1::WatchEventsRequest());
  for (int i = 0; i < 100 && server().service().watchers() < 1; ++i) absl::SleepFor(absl::Milliseconds(5));
  Watched second = Watch(0, 1);
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << Describe(second.status);
  first_ctx.TryCancel();
  EXPECT_EQ(first->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

// A limit past INT_MAX (the field is a uint32) is as good as none; it used
// to wrap to a negative one that turned every watcher away.
TEST_F(WatchEventsTest, AWatcherLimitPastIntMaxAdmitsWatchers) {
  StopServer();
  StartServer("cpu", "name: 'default' num_layers: 1 page_size: 4 num_pages: 16", "events { max_watchers: 4294967295 }");
  Watched w = Watch(1, 1);  // the server's first event: everything cleared
  EXPECT_TRUE(w.status.ok() || w.status.error_code() == grpc::StatusCode::CANCELLED) << Describe(w.status);
  ASSERT_EQ(w.events.size(), 1u) << Describe(w.status);
}

}  // namespace
}  // namespace mlakv::server::testing
