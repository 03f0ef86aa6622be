// The service under faults, in process (cpu backend): a stream that ends any
// way but a clean half-close commits nothing; a call that fails is not
// applied; nothing the server can foresee fails after a commit; every input
// gets a bounded, actionable status (docs/reliability.md). The same faults
// against the real server process: tests/faults/.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "tests/server/rpc/service_fixture.h"

namespace mlakv::server::testing {
namespace {

constexpr float kCkv = 0.125f, kKpe = 0.5f;

class ServiceFaults : public ::testing::Test, public ServiceFixture {
 protected:
  void Start(const std::string& pool_text = "num_layers: 2 page_size: 4 num_pages: 64", const std::string& extra = "") {
    StartServer("cpu", pool_text, extra);
  }
  void ExpectNothingLeft(const std::string& sequence) {
    v1::Sequence seq;
    EXPECT_EQ(GetSequence(sequence, &seq).error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(GetPool().pages_used(), 0u);
    EXPECT_TRUE(pool().CheckInvariants().ok()) << pool().CheckInvariants();
  }
};

TEST_F(ServiceFaults, SecondMessageWithInvalidUtf8RollsTheStreamBack) {
  Start();
  const Rows rows = RandomRows(8, 1);
  v1::AppendRequest first = AppendMessage("s", 0, rows, 0, 4, {0, 1}, kCkv, kKpe);
  v1::AppendRequest second = AppendMessage("", 4, rows, 4, 4, {0, 1});
  second.set_sequence("s\xff\xfe");  // proto3 string: not UTF-8, the server cannot parse it
  const grpc::Status status = Append({first, second});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "message 2")) << Describe(status);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "rolled back")) << Describe(status);
  ExpectNothingLeft("s");
}

TEST_F(ServiceFaults, SecondMessageOverTheSizeLimitRollsTheStreamBack) {
  Start("num_layers: 2 page_size: 4 num_pages: 64", "max_message_bytes: 65536");
  const Rows rows = RandomRows(70, 2);
  v1::AppendRequest first = AppendMessage("s", 0, rows, 0, 4, {0}, kCkv, kKpe);
  v1::AppendRequest second = AppendMessage("", 4, rows, 4, 66, {0});  // 66 x 1152 bytes > 64 KiB
  for (int round = 0; round < 20; ++round) {
    const grpc::Status status = Append({first, second});
    ASSERT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << round << " " << Describe(status);
    EXPECT_TRUE(absl::StrContains(status.error_message(), "max_message_bytes")) << Describe(status);
    ExpectNothingLeft("s");
  }
}

TEST_F(ServiceFaults, OversizedAppendBatchIsRefused) {
  Start("num_layers: 2 page_size: 4 num_pages: 64", "max_message_bytes: 65536");
  const Rows rows = RandomRows(60, 3);
  v1::AppendBatchRequest req;
  req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  v1::SequenceRows* s = req.add_sequences();
  s->set_sequence("b");
  s->set_row_count(60);
  v1::LayerRows* l = s->add_layers();
  l->set_ckv(rows.ckv_bytes());
  l->set_kpe(rows.kpe_bytes());
  l->set_ckv_scale(kCkv);
  l->set_kpe_scale(kKpe);
  grpc::ClientContext ctx;
  v1::AppendBatchResponse resp;
  const grpc::Status status = stub().AppendBatch(&ctx, req, &resp);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << Describe(status);
  ExpectNothingLeft("b");
}

TEST_F(ServiceFaults, IdleStreamIsEndedAndItsReservationReturned) {
  Start("num_layers: 2 page_size: 4 num_pages: 64", "append_idle_timeout_seconds: 1");
  v1::AppendRequest first;
  first.set_sequence("idle");
  first.set_reserve_tokens(40);
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = stub().Append(&ctx, &resp);
  ASSERT_TRUE(writer->Write(first));
  // The reservation is staged: 10 pages held while the stream is open.
  for (int i = 0; i < 100 && GetPool().pages_used() == 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(GetPool().pages_used(), 10u);
  const auto started = std::chrono::steady_clock::now();
  const grpc::Status status = writer->Finish();  // never half-closed: the server ends it
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(status);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "append_idle_timeout_seconds")) << Describe(status);
  EXPECT_LT(waited, 3.0);
  ExpectNothingLeft("idle");
}

// No first message at all: nothing staged, nothing queued -- the watchdog
// itself must end the call (it once only marked it finishing, and the
// client waited forever; a graceful shutdown then waited for it too).
TEST_F(ServiceFaults, AStreamThatNeverSendsAMessageIsEndedAtTheIdleTimeout) {
  Start("num_layers: 2 page_size: 4 num_pages: 64", "append_idle_timeout_seconds: 1");
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::AppendResponse resp;
  const auto started = std::chrono::steady_clock::now();
  auto writer = stub().Append(&ctx, &resp);
  const grpc::Status status = writer->Finish();  // nothing written, never half-closed
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(status);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "append_idle_timeout_seconds")) << Describe(status);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "after message 0")) << Describe(status);
  EXPECT_LT(waited, 4.0);
  // What a drain waits for before the server shuts down; and the call's
  // end (OnDone, after the client has its status, takes it off the watchdog).
  for (int i = 0; i < 500 && (server().service().appends_in_flight() != 0 || server().service().watchdog().size() != 0);
       ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(server().service().appends_in_flight(), 0);
  EXPECT_EQ(server().service().watchdog().size(), 0u);
  EXPECT_EQ(GetPool().pages_used(), 0u);
}

TEST_F(ServiceFaults, AStreamThatSendsSteadilyIsNotIdle) {
  Start("num_layers: 2 page_size: 4 num_pages: 64", "append_idle_timeout_seconds: 1");
  const Rows rows = RandomRows(8, 4);
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = stub().Append(&ctx, &resp);
  for (uint32_t i = 0; i < 8; ++i) {
    ASSERT_TRUE(writer->Write(AppendMessage(i == 0 ? "steady" : "", i, rows, i, 1, {0, 1}, kCkv, kKpe)));
    absl::SleepFor(absl::Milliseconds(400));  // 3.2 s in all, never 1 s without a message
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_EQ(resp.sequence().length(), 8u);
}

TEST_F(ServiceFaults, AppendBatchWhoseDeadlinePassesWhileQueuedIsNotApplied) {
  Start();
  const Rows rows = RandomRows(2, 5);
  v1::AppendBatchRequest req;
  req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  v1::SequenceRows* s = req.add_sequences();
  s->set_sequence("late");
  s->set_row_count(2);
  v1::LayerRows* l = s->add_layers();
  l->set_ckv(rows.ckv_bytes());
  l->set_kpe(rows.kpe_bytes());
  l->set_ckv_scale(kCkv);
  l->set_kpe_scale(kKpe);
  for (int round = 0; round < 10; ++round) {
    std::unique_ptr<absl::Notification> release = BlockWorker();
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    v1::AppendBatchResponse resp;
    grpc::Status status;
    std::thread call([&] { status = stub().AppendBatch(&ctx, req, &resp); });
    absl::SleepFor(absl::Milliseconds(300));  // past the deadline, still queued
    release->Notify();
    call.join();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(status);
    // The worker has run the queued call by now (or is about to): wait for it, then look.
    absl::Notification drained;
    pool().worker().Post([&] { drained.Notify(); });
    drained.WaitForNotification();
    ExpectNothingLeft("late");
  }
}

TEST_F(ServiceFaults, AppendStreamWhoseDeadlinePassesBeforeItsCommitIsNotApplied) {
  Start();
  const Rows rows = RandomRows(4, 6);
  for (int round = 0; round < 10; ++round) {
    std::unique_ptr<absl::Notification> release = BlockWorker();
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    v1::AppendResponse resp;
    auto writer = stub().Append(&ctx, &resp);
    writer->Write(AppendMessage("late", 0, rows, 0, 4, {0, 1}, kCkv, kKpe));
    writer->WritesDone();  // a clean half-close, but the deadline passes before the worker gets to it
    absl::SleepFor(absl::Milliseconds(300));
    release->Notify();
    const grpc::Status status = writer->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(status);
    absl::Notification drained;
    pool().worker().Post([&] { drained.Notify(); });
    drained.WaitForNotification();
    ExpectNothingLeft("late");
  }
}

TEST_F(ServiceFaults, CancelledStreamBeforeItsCommitIsNotApplied) {
  Start();
  const Rows rows = RandomRows(4, 7);
  for (int round = 0; round < 10; ++round) {
    std::unique_ptr<absl::Notification> release = BlockWorker();
    grpc::ClientContext ctx;
    v1::AppendResponse resp;
    auto writer = stub().Append(&ctx, &resp);
    writer->Write(AppendMessage("gone", 0, rows, 0, 4, {0, 1}, kCkv, kKpe));
    // Half of the rounds cancel mid-stream, half after the half-close; in
    // both the cancel reaches the server before the worker decides. (A
    // cancel that arrives after the commit cannot undo it: see
    // docs/reliability.md "Retries".)
    if (round % 2 == 1) writer->WritesDone();
    ctx.TryCancel();
    absl::SleepFor(absl::Milliseconds(100));
    release->Notify();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
    absl::Notification drained;
    pool().worker().Post([&] { drained.Notify(); });
    drained.WaitForNotification();
    ExpectNothingLeft("gone");
  }
}

// A sequence of `pages` pages of page size 1, built in appends of 50 rows
// asking for the BASIC view (their FULL responses would pass the limit too).
void Build(ServiceFixture& f, const std::string& id, int pages) {
  const Rows rows = RandomRows(50, 8);
  for (int done = 0; done < pages; done += 50) {
    v1::AppendRequest m = AppendMessage(id, done, rows, 0, 50, {0}, kCkv, kKpe);
    m.set_view(v1::SEQUENCE_VIEW_BASIC);
    const grpc::Status s = f.Append({m});
    ASSERT_TRUE(s.ok()) << done << " " << Describe(s);
  }
}

// Messages queued on a busy worker when the client cancels are not staged:
// staging them would take pages -- evicting an idle sequence for them --
// only for the rollback to give the pages back.
TEST_F(ServiceFaults, ACancelledStreamsQueuedMessagesEvictNothing) {
  Start("num_layers: 2 page_size: 4 num_pages: 8 eviction { policy: 'lru' }");
  const Rows rows = RandomRows(32, 8);
  ASSERT_TRUE(AppendRows("victim", 0, RandomRows(16, 9), {0, 1}, kCkv, kKpe).ok());  // 4 pages, idle from now on
  std::unique_ptr<absl::Notification> release = BlockWorker();
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = stub().Append(&ctx, &resp);
  ASSERT_TRUE(writer->Write(AppendMessage("cancelled", 0, rows, 0, 16, {0, 1}, kCkv, kKpe)));  // the 4 free pages
  ASSERT_TRUE(writer->Write(AppendMessage("", 16, rows, 16, 16, {0, 1})));  // 4 more: the victim's
  absl::SleepFor(absl::Milliseconds(200));  // both read and queued behind the blocker
  ctx.TryCancel();
  absl::SleepFor(absl::Milliseconds(100));  // the cancel read too
  release->Notify();
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  absl::Notification drained;
  pool().worker().Post([&] { drained.Notify(); });
  drained.WaitForNotification();
  v1::Sequence victim;
  ASSERT_TRUE(GetSequence("victim", &victim).ok()) << "evicted for a cancelled stream's message";
  EXPECT_EQ(victim.length(), 16u);
  EXPECT_EQ(GetPool().evictions(), 0u);
  EXPECT_EQ(GetPool().pages_used(), 4u);
  EXPECT_TRUE(pool().CheckInvariants().ok()) << pool().CheckInvariants();
}

TEST_F(ServiceFaults, AResponseOverTheSendLimitIsRefusedBeforeTheCommit) {
  // 25,000 page ids below 30,000 take 3 bytes each in a FULL response:
  // 75 KB, over a 64 KiB limit.
  Start("num_layers: 1 page_size: 1 num_pages: 30000", "max_message_bytes: 65536");
  Build(*this, "long", 25000);
  const Rows one = RandomRows(1, 9);
  v1::AppendRequest more = AppendMessage("long", 25000, one, 0, 1, {0});
  const grpc::Status full = Append({more});
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << Describe(full);
  EXPECT_TRUE(absl::StrContains(full.error_message(), "SEQUENCE_VIEW_BASIC")) << Describe(full);
  EXPECT_EQ(GetPool().layers(0).tokens(), 25000u);  // nothing was written
  // The same append asking for the BASIC view commits and carries one page id.
  more.set_view(v1::SEQUENCE_VIEW_BASIC);
  v1::AppendResponse resp;
  const grpc::Status basic = Append({more}, &resp);
  ASSERT_TRUE(basic.ok()) << Describe(basic);
  EXPECT_EQ(resp.sequence().kv_indices_size(), 1);
  EXPECT_EQ(resp.sequence().kv_indices_offset(), 25000u);
  EXPECT_EQ(resp.sequence().length(), 25001u);
  EXPECT_EQ(resp.sequence().layer_lengths_size(), 0);
  EXPECT_TRUE(pool().CheckInvariants().ok());
}

TEST_F(ServiceFaults, AppendBatchResponseOverTheSendLimitIsRefusedBeforeTheCommit) {
  Start("num_layers: 1 page_size: 1 num_pages: 30000", "max_message_bytes: 65536");
  Build(*this, "long", 25000);
  const Rows one = RandomRows(1, 10);
  v1::AppendBatchRequest req;
  req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  for (const char* id : {"long", "other"}) {
    v1::SequenceRows* s = req.add_sequences();
    s->set_sequence(id);
    s->set_start(std::string(id) == "long" ? 25000 : 0);
    s->set_row_count(1);
    v1::LayerRows* l = s->add_layers();
    l->set_ckv(one.ckv_bytes());
    l->set_kpe(one.kpe_bytes());
  }
  {
    grpc::ClientContext ctx;
    v1::AppendBatchResponse resp;
    const grpc::Status status = stub().AppendBatch(&ctx, req, &resp);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << Describe(status);
    EXPECT_EQ(GetPool().layers(0).tokens(), 25000u);
    v1::Sequence other;
    EXPECT_EQ(GetSequence("other", &other).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  req.set_view(v1::SEQUENCE_VIEW_BASIC);
  grpc::ClientContext ctx;
  v1::AppendBatchResponse resp;
  const grpc::Status status = stub().AppendBatch(&ctx, req, &resp);
  ASSERT_TRUE(status.ok()) << Describe(status);
  ASSERT_EQ(resp.sequences_size(), 2);
  EXPECT_EQ(resp.sequences(0).kv_indices_size(), 1);
  EXPECT_EQ(resp.sequences(0).kv_indices_offset(), 25000u);
  EXPECT_EQ(resp.sequences(1).kv_indices_offset(), 0u);
  EXPECT_EQ(resp.sequences(1).kv_indices_size(), 1);
}

// The send limit counts the page ids a view carries: 25,000 new pages in one
// stream are refused in BASIC (the response would name them all) and commit
// in LENGTHS, which names none.
TEST_F(ServiceFaults, TheLengthsViewIsNeverRefusedForItsPageTable) {
  Start("num_layers: 1 page_size: 1 num_pages: 30000", "max_message_bytes: 65536");
  const Rows rows = RandomRows(50, 12);
  std::vector<v1::AppendRequest> messages;
  for (int done = 0; done < 25000; done += 50) {
    messages.push_back(AppendMessage(messages.empty() ? "long" : "", done, rows, 0, 50, {0}, kCkv, kKpe));
  }
  messages.front().set_view(v1::SEQUENCE_VIEW_BASIC);
  const grpc::Status basic = Append(messages);
  EXPECT_EQ(basic.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << Describe(basic);
  EXPECT_TRUE(absl::StrContains(basic.error_message(), "LENGTHS")) << Describe(basic);
  EXPECT_EQ(GetPool().pages_used(), 0u);  // nothing was written
  messages.front().set_view(v1::SEQUENCE_VIEW_LENGTHS);
  v1::AppendResponse resp;
  const grpc::Status lengths = Append(messages, &resp);
  ASSERT_TRUE(lengths.ok()) << Describe(lengths);
  EXPECT_EQ(resp.sequence().length(), 25000u);
  EXPECT_EQ(resp.sequence().kv_indices_size(), 0);
  EXPECT_EQ(resp.sequence().kv_indices_offset(), 25000u);
  EXPECT_EQ(resp.pages_allocated(), 25000u);
  EXPECT_TRUE(pool().CheckInvariants().ok());
}

TEST_F(ServiceFaults, ARetryWithExpectLengthCannotDuplicateTokens) {
  Start();
  const Rows rows = RandomRows(4, 11);
  v1::AppendRequest m = AppendMessage("s", 0, rows, 0, 4, {0, 1}, kCkv, kKpe);
  m.set_expect_length(0);
  ASSERT_TRUE(Append({m}).ok());
  // The response was "lost"; the client retries the same call.
  const grpc::Status retry = Append({m});
  EXPECT_EQ(retry.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(retry);
  v1::Sequence seq;
  ASSERT_TRUE(GetSequence("s", &seq).ok());
  EXPECT_EQ(seq.length(), 4u);
}

TEST_F(ServiceFaults, OverLongNamesAreInvalidArgumentWithABoundedMessage) {
  Start();
  const std::string huge(65536, 'q');
  v1::Sequence seq;
  const grpc::Status get = GetSequence(huge, &seq);
  EXPECT_EQ(get.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << get.error_message().size();
  EXPECT_LT(get.error_message().size(), 400u);
  grpc::ClientContext ctx;
  v1::GetPoolRequest req;
  req.set_pool(huge);
  v1::Pool p;
  const grpc::Status pool_status = stub().GetPool(&ctx, req, &p);
  EXPECT_EQ(pool_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LT(pool_status.error_message().size(), 400u);
  const Rows rows = RandomRows(1, 12);
  const grpc::Status append = Append({AppendMessage(huge, 0, rows, 0, 1, {0}, kCkv, kKpe)});
  EXPECT_EQ(append.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LT(append.error_message().size(), 400u);
  EXPECT_EQ(GetPool().pages_used(), 0u);
}

TEST_F(ServiceFaults, ControlCharactersInIdsAreEscapedInStatuses) {
  Start();
  v1::Sequence seq;
  const grpc::Status s = GetSequence("fake\n2026-12-01T00:00:00.000Z info forged", &seq);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_FALSE(absl::StrContains(s.error_message(), "\n")) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "fake\\n2026")) << s.error_message();
}

TEST_F(ServiceFaults, ReadSequenceNamingALayerTwiceIsInvalidArgument) {
  Start();
  ASSERT_TRUE(AppendRows("s", 0, RandomRows(2, 13), {0, 1}, kCkv, kKpe).ok());
  v1::ReadSequenceRequest req;
  req.set_sequence("s");
  for (int i = 0; i < 1000; ++i) req.add_layers(0);
  grpc::ClientContext ctx;
  auto reader = stub().ReadSequence(&ctx, req);
  v1::ReadSequenceResponse resp;
  int messages = 0;
  while (reader->Read(&resp)) ++messages;
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(messages, 0);
}

TEST_F(ServiceFaults, ZeroRowAppendsLeaveNoSequences) {
  Start();
  for (int i = 0; i < 300; ++i) {
    v1::AppendRequest m;
    m.set_sequence("empty-" + std::to_string(i));
    ASSERT_TRUE(Append({m}).ok());
  }
  EXPECT_EQ(GetPool().sequences(), 0u);
}

TEST_F(ServiceFaults, HugeRowCountIsInvalidArgument) {
  Start();
  v1::AppendRequest m;
  m.set_sequence("s");
  m.set_row_count(0xffffffffu);
  m.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  m.add_layers()->set_layer(0);
  const grpc::Status s = Append({m});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
}

TEST_F(ServiceFaults, MoreLayerEntriesThanLayersIsInvalidArgument) {
  Start();
  v1::AppendRequest m;
  m.set_sequence("s");
  for (int i = 0; i < 5000; ++i) m.add_layers()->set_layer(i % 2);
  const grpc::Status s = Append({m});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
}

}  // namespace
}  // namespace mlakv::server::testing
