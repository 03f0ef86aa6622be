// CommitAppend: an open Append stream committed by a unary call naming its
// commit_token and its message count (docs/server.md "Committing an Append
// stream by a unary call"), in process on the cpu backend. The promise under
// test is the stream's own: committed once, with every message the call
// named and nothing else, or rolled back with nothing left -- whichever of
// the commit call, the half-close, a late message, a failing message, a
// cancel or the idle timeout comes first -- and the commit call answered
// with the stream's own status and response. Plus: a token names one open
// stream at a time, a second commit of a token finds nothing, and no token
// outlives its stream.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "tests/server/rpc/service_fixture.h"

namespace mlakv::server::testing {
namespace {

constexpr float kCkv = 0.125f, kKpe = 0.5f;

class CommitAppendTest : public ::testing::Test, public ServiceFixture {
 protected:
  void Start(const std::string& extra = "") { StartServer("cpu", "num_layers: 2 page_size: 4 num_pages: 1024", extra); }
  void TearDown() override {
    EXPECT_EQ(server().service().open_appends().size(), 0u) << "a commit_token outlived its stream";
    EXPECT_TRUE(pool().CheckInvariants().ok()) << pool().CheckInvariants();
    StopServer();
  }

  // Message `i` of a stream writing rows [4i, 4i + 4) of `rows` to both
  // layers; the first names the sequence, the scales and `token`.
  static v1::AppendRequest Message(const std::string& sequence, const Rows& rows, int i,
                                   const std::string& token = "") {
    v1::AppendRequest m = i == 0 ? AppendMessage(sequence, 0, rows, 0, 4, {0, 1}, kCkv, kKpe)
                                 : AppendMessage("", 4 * i, rows, 4 * i, 4, {0, 1});
    if (i == 0) m.set_commit_token(token);
    return m;
  }
  grpc::Status Commit(const std::string& token, uint32_t messages, v1::AppendResponse* resp = nullptr) {
    v1::CommitAppendRequest req;
    req.set_commit_token(token);
    req.set_messages(messages);
    v1::AppendResponse ignored;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    return stub().CommitAppend(&ctx, req, resp != nullptr ? resp : &ignored);
  }
  std::future<grpc::Status> CommitLater(const std::string& token, uint32_t messages, v1::AppendResponse* resp) {
    return std::async(std::launch::async, [=, this] { return Commit(token, messages, resp); });
  }
  void WaitForPages(uint64_t pages) {
    for (int i = 0; i < 500 && GetPool().pages_used() < pages; ++i) absl::SleepFor(absl::Milliseconds(4));
    ASSERT_GE(GetPool().pages_used(), pages);
  }
  void ExpectNothingLeft(const std::string& sequence) {
    v1::Sequence seq;
    EXPECT_EQ(GetSequence(sequence, &seq).error_code(), grpc::StatusCode::NOT_FOUND) << sequence;
    for (int i = 0; i < 500 && GetPool().pages_used() != 0; ++i) absl::SleepFor(absl::Milliseconds(4));
    EXPECT_EQ(GetPool().pages_used(), 0u) << sequence;
  }
  // `sequence` holds rows [0, n) of `rows` in both layers, as a stream
  // committed by its half-close stores them.
  void ExpectCommitted(const std::string& sequence, const Rows& rows, uint32_t n) {
    const std::string reference = sequence + "-reference";
    ASSERT_TRUE(AppendRows(reference, 0, rows, {0, 1}, kCkv, kKpe, 4).ok());
    v1::Sequence seq;
    ASSERT_TRUE(GetSequence(sequence, &seq).ok()) << sequence;
    EXPECT_EQ(seq.length(), n);
    ExpectSameStored(sequence, reference, {0, 1}, n);
    v1::FreeSequenceRequest free;
    free.set_sequence(reference);
    v1::FreeSequenceResponse freed;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub().FreeSequence(&ctx, free, &freed).ok());
  }
};

TEST_F(CommitAppendTest, CommitsAfterTheNamedMessagesAndTheStreamEndsWithTheSameAnswer) {
  Start();
  const Rows rows = RandomRows(8, 1);
  grpc::ClientContext ctx;
  v1::AppendResponse streamed;
  auto writer = stub().Append(&ctx, &streamed);
  ASSERT_TRUE(writer->Write(Message("s", rows, 0, "token-1")));
  ASSERT_TRUE(writer->Write(Message("s", rows, 1)));
  v1::AppendResponse committed;
  const grpc::Status s = Commit("token-1", 2, &committed);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(committed.rows_written(), 16u);
  EXPECT_EQ(committed.sequence().length(), 8u);
  // Visible as soon as CommitAppend answered, before the stream's end.
  ExpectCommitted("s", rows, 8);
  // The stream itself ends with the same answer, half-closed or not.
  writer->WritesDone();
  const grpc::Status end = writer->Finish();
  ASSERT_TRUE(end.ok()) << Describe(end);
  EXPECT_EQ(streamed.SerializeAsString(), committed.SerializeAsString());
  // A token is its stream's: once the stream has ended, nothing holds it.
  EXPECT_EQ(Commit("token-1", 2).error_code(), grpc::StatusCode::NOT_FOUND);
}

// Committed by CommitAppend, the stream's own end waits for the client:
// its half-close (OK), a message more (FAILED_PRECONDITION, not written), a
// cancel, or the idle timeout (OK). The commit stands in every case.
TEST_F(CommitAppendTest, AfterTheCommitTheStreamEndsWhenTheClientEndsItAndTheCommitStands) {
  Start("append_idle_timeout_seconds: 1");
  const Rows rows = RandomRows(12, 14);
  for (const std::string how : {"message", "cancel", "idle"}) {
    SCOPED_TRACE(how);
    grpc::ClientContext ctx;
    v1::AppendResponse streamed;
    auto writer = stub().Append(&ctx, &streamed);
    ASSERT_TRUE(writer->Write(Message(how, rows, 0, how)));
    ASSERT_TRUE(writer->Write(Message(how, rows, 1)));
    v1::AppendResponse committed;
    const grpc::Status s = Commit(how, 2, &committed);
    ASSERT_TRUE(s.ok()) << Describe(s);
    const absl::Time t0 = absl::Now();
    grpc::Status end;
    if (how == "message") {
      writer->Write(Message(how, rows, 2));
      end = writer->Finish();
      EXPECT_EQ(end.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(end);
      EXPECT_TRUE(absl::StrContains(end.error_message(), "was not written")) << Describe(end);
    } else if (how == "cancel") {
      absl::SleepFor(absl::Milliseconds(50));
      ctx.TryCancel();
      end = writer->Finish();
      EXPECT_EQ(end.error_code(), grpc::StatusCode::CANCELLED) << Describe(end);
    } else {
      end = writer->Finish();  // never half-closed
      EXPECT_TRUE(end.ok()) << Describe(end);
      EXPECT_GE(absl::Now() - t0, absl::Milliseconds(500)) << "ended before the idle timeout";
      EXPECT_LT(absl::Now() - t0, absl::Seconds(4));
    }
    v1::Sequence seq;
    ASSERT_TRUE(GetSequence(how, &seq).ok());
    EXPECT_EQ(seq.length(), 8u) << "the two messages CommitAppend named, nothing more";
    Free(how);
  }
}

TEST_F(CommitAppendTest, ACommitThatComesBeforeItsLastMessageWaitsForIt) {
  Start();
  const Rows rows = RandomRows(12, 2);
  grpc::ClientContext ctx;
  v1::AppendResponse streamed;
  auto writer = stub().Append(&ctx, &streamed);
  ASSERT_TRUE(writer->Write(Message("s", rows, 0, "early")));
  v1::AppendResponse committed;
  std::future<grpc::Status> commit = CommitLater("early", 3, &committed);
  ASSERT_TRUE(writer->Write(Message("s", rows, 1)));
  EXPECT_EQ(commit.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "committed before its third message came";
  v1::Sequence seq;
  EXPECT_EQ(GetSequence("s", &seq).error_code(), grpc::StatusCode::NOT_FOUND) << "visible before its commit";
  ASSERT_TRUE(writer->Write(Message("s", rows, 2)));
  const grpc::Status s = commit.get();
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(committed.rows_written(), 24u);
  ExpectCommitted("s", rows, 12);
  writer->WritesDone();
  EXPECT_TRUE(writer->Finish().ok());
}

TEST_F(CommitAppendTest, AStreamWithATokenStillCommitsAtItsHalfClose) {
  Start();
  const Rows rows = RandomRows(8, 3);
  v1::AppendResponse resp;
  const grpc::Status s = Append({Message("s", rows, 0, "unused"), Message("s", rows, 1)}, &resp);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(resp.rows_written(), 16u);
  ExpectCommitted("s", rows, 8);
  EXPECT_EQ(Commit("unused", 2).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(CommitAppendTest, ACommitNamingFewerMessagesThanCameRollsBack) {
  Start();
  const Rows rows = RandomRows(8, 4);
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = stub().Append(&ctx, &resp);
  ASSERT_TRUE(writer->Write(Message("s", rows, 0, "fewer")));
  ASSERT_TRUE(writer->Write(Message("s", rows, 1)));
  ASSERT_NO_FATAL_FAILURE(WaitForPages(2));  // both messages staged: 8 tokens, 4 per page
  const grpc::Status s = Commit("fewer", 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "named 1 messages")) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "rolled back")) << Describe(s);
  writer->WritesDone();
  const grpc::Status end = writer->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(end);
  ExpectNothingLeft("s");
}

TEST_F(CommitAppendTest, AMessageAfterTheNamedCountRollsBackACommitNotYetRun) {
  Start();
  const Rows rows = RandomRows(8, 5);
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = stub().Append(&ctx, &resp);
  ASSERT_TRUE(writer->Write(Message("s", rows, 0, "late")));
  ASSERT_NO_FATAL_FAILURE(WaitForPages(1));
  // The commit is due at once but queued behind a busy worker; a second
  // message comes meanwhile: the client's count was wrong, nothing commits.
  auto release = BlockWorker();
  std::future<grpc::Status> commit = CommitLater("late", 1, nullptr);
  absl::SleepFor(absl::Milliseconds(100));
  ASSERT_TRUE(writer->Write(Message("s", rows, 1)));
  absl::SleepFor(absl::Milliseconds(100));
  release->Notify();
  const grpc::Status s = commit.get();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "message 2 of the Append stream came after")) << Describe(s);
  writer->WritesDone();
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ExpectNothingLeft("s");
}

// Once a commit has passed its last check it lands; what the client does
// in the window before the pool commits must not be reported as a rollback
// (nor silently accepted). The fixture's hook holds the first commit there.
class CommitAppendRaceTest : public CommitAppendTest {
 protected:
  void SetUp() override {
    set_after_last_check([this] {
      if (!armed_.exchange(false)) return;  // the first commit only (not ExpectCommitted's reference)
      reached_.Notify();
      release_.WaitForNotification();
    });
    Start();
  }
  void TearDown() override {
    if (!release_.HasBeenNotified()) release_.Notify();  // a failed step must not leave the worker held
    CommitAppendTest::TearDown();
  }
  void HoldFirstCommitThen(const std::function<void()>& meanwhile) {
    ASSERT_TRUE(reached_.WaitForNotificationWithTimeout(absl::Seconds(10))) << "no commit reached its last check";
    meanwhile();
    absl::SleepFor(absl::Milliseconds(200));  // the server reads what came meanwhile
    release_.Notify();
  }
  std::atomic<bool> armed_{true};
  absl::Notification reached_, release_;
};

TEST_F(CommitAppendRaceTest, AMessageAfterTheCountOnceTheCommitIsCertainIsNotWrittenAndSaysSo) {
  const Rows rows = RandomRows(12, 21);
  grpc::ClientContext ctx;
  v1::AppendResponse streamed;
  auto writer = stub().Append(&ctx, &streamed);
  ASSERT_TRUE(writer->Write(Message("s", rows, 0, "certain")));
  ASSERT_TRUE(writer->Write(Message("s", rows, 1)));
  v1::AppendResponse committed;
  std::future<grpc::Status> commit = CommitLater("certain", 2, &committed);
  ASSERT_NO_FATAL_FAILURE(HoldFirstCommitThen([&] { writer->Write(Message("s", rows, 2)); }));
  const grpc::Status s = commit.get();
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(committed.sequence().length(), 8u);
  writer->WritesDone();
  const grpc::Status end = writer->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(end);
  EXPECT_TRUE(absl::StrContains(end.error_message(), "was not written")) << Describe(end);
  ExpectCommitted("s", rows, 8);
  Free("s");
}

TEST_F(CommitAppendRaceTest, ACommitNamingAnotherCountOnceTheHalfClosesCommitIsCertainIsRefused) {
  const Rows rows = RandomRows(8, 22);
  grpc::ClientContext ctx;
  v1::AppendResponse streamed;
  auto writer = stub().Append(&ctx, &streamed);
  ASSERT_TRUE(writer->Write(Message("s", rows, 0, "half-closed")));
  ASSERT_TRUE(writer->Write(Message("s", rows, 1)));
  // The half-close's commit on the pool's worker (queued behind a blocker),
  // not in place on the completion-queue thread that read the half-close:
  // held there, it would hold the queue's polling turn too, and CommitAppend
  // would not be read until it ended.
  ASSERT_NO_FATAL_FAILURE(WaitForPages(2));  // both messages staged: 8 tokens, 4 per page
  auto blocker = BlockWorker();
  writer->WritesDone();
  for (int i = 0; i < 1000 && pool().worker().pending() < 2; ++i) absl::SleepFor(absl::Milliseconds(10));
  const size_t queued = pool().worker().pending();
  blocker->Notify();  // the commit runs, and is held after its last check
  ASSERT_EQ(queued, 2u) << "the blocker and the half-close's commit";
  std::future<grpc::Status> commit;
  ASSERT_NO_FATAL_FAILURE(HoldFirstCommitThen([&] {
    commit = CommitLater("half-closed", 1, nullptr);
    // The call has reached the stream once it took the token from the registry.
    for (int i = 0; i < 1000 && server().service().open_appends().size() != 0; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_EQ(server().service().open_appends().size(), 0u) << "CommitAppend never reached the stream";
  }));
  const grpc::Status s = commit.get();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "named 1 messages")) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "that commit stands")) << Describe(s);
  const grpc::Status end = writer->Finish();
  ASSERT_TRUE(end.ok()) << Describe(end);
  EXPECT_EQ(streamed.sequence().length(), 8u);
  ExpectCommitted("s", rows, 8);
  Free("s");
}

TEST_F(CommitAppendTest, AStreamThatEndsBeforeTheNamedMessagesRollsBack) {
  Start();
  const Rows rows = RandomRows(8, 6);
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = stub().Append(&ctx, &resp);
  ASSERT_TRUE(writer->Write(Message("s", rows, 0, "short")));
  std::future<grpc::Status> commit = CommitLater("short", 3, nullptr);
  absl::SleepFor(absl::Milliseconds(100));
  writer->WritesDone();
  const grpc::Status s = commit.get();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "ended after 1 messages")) << Describe(s);
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ExpectNothingLeft("s");
}

TEST_F(CommitAppendTest, ACommitOfAStreamWhoseMessageFailsGetsThatFailure) {
  Start();
  const Rows rows = RandomRows(8, 7);
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = stub().Append(&ctx, &resp);
  auto release = BlockWorker();  // both messages and the commit queue up behind it
  ASSERT_TRUE(writer->Write(Message("s", rows, 0, "bad")));
  v1::AppendRequest bad = Message("s", rows, 1);
  bad.mutable_layers(1)->set_layer(7);  // the pool has 2 layers
  ASSERT_TRUE(writer->Write(bad));
  absl::SleepFor(absl::Milliseconds(100));
  std::future<grpc::Status> commit = CommitLater("bad", 2, nullptr);
  absl::SleepFor(absl::Milliseconds(100));
  release->Notify();
  const grpc::Status s = commit.get();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "message 2")) << Describe(s);
  writer->WritesDone();
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::OUT_OF_RANGE);
  ExpectNothingLeft("s");
}

TEST_F(CommitAppendTest, ACancelWhileTheCommitWaitsAnswersItCancelled) {
  Start();
  const Rows rows = RandomRows(8, 8);
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = stub().Append(&ctx, &resp);
  ASSERT_TRUE(writer->Write(Message("s", rows, 0, "cancelled")));
  std::future<grpc::Status> commit = CommitLater("cancelled", 2, nullptr);
  absl::SleepFor(absl::Milliseconds(100));
  ctx.TryCancel();
  const grpc::Status s = commit.get();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << Describe(s);
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  ExpectNothingLeft("s");
}

TEST_F(CommitAppendTest, ACommitWaitingForMessagesThatNeverComeEndsAtTheIdleTimeout) {
  Start("append_idle_timeout_seconds: 1");
  const Rows rows = RandomRows(8, 9);
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = stub().Append(&ctx, &resp);
  ASSERT_TRUE(writer->Write(Message("s", rows, 0, "idle")));
  const absl::Time t0 = absl::Now();
  const grpc::Status s = Commit("idle", 2);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "append_idle_timeout_seconds")) << Describe(s);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(4));
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ExpectNothingLeft("s");
}

TEST_F(CommitAppendTest, BadRequestsAreRefusedAndLeaveTheStreamOpen) {
  Start();
  const Rows rows = RandomRows(8, 10);
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = stub().Append(&ctx, &resp);
  ASSERT_TRUE(writer->Write(Message("s", rows, 0, "open")));
  grpc::Status s = Commit("open", 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "messages is 0")) << Describe(s);
  s = Commit("", 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  const std::string long_token(5000, 'x');
  s = Commit(long_token, 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  EXPECT_LT(s.error_message().size(), 600u) << "the quote of the token is bounded";
  s = Commit("nope\n\x01", 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "'nope\\n\\x01'")) << Describe(s);
  // None of them touched the stream: it commits by its half-close.
  ASSERT_TRUE(writer->Write(Message("s", rows, 1)));
  writer->WritesDone();
  s = writer->Finish();
  ASSERT_TRUE(s.ok()) << Describe(s);
  ExpectCommitted("s", rows, 8);
}

TEST_F(CommitAppendTest, BadTokensInTheStreamRollItBack) {
  Start();
  const Rows rows = RandomRows(8, 11);
  // Over-long in the first message.
  grpc::Status s = Append({Message("a", rows, 0, std::string(129, 't'))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "commit_token")) << Describe(s);
  ExpectNothingLeft("a");
  // Set in a later message.
  v1::AppendRequest second = Message("b", rows, 1);
  second.set_commit_token("later");
  s = Append({Message("b", rows, 0), second});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "only the first message")) << Describe(s);
  ExpectNothingLeft("b");
}

TEST_F(CommitAppendTest, OneOpenStreamPerTokenAndOneCommitPerStream) {
  Start();
  const Rows rows = RandomRows(8, 12);
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto writer = stub().Append(&ctx, &resp);
  ASSERT_TRUE(writer->Write(Message("first", rows, 0, "dup")));
  ASSERT_NO_FATAL_FAILURE(WaitForPages(1));
  // A second stream naming the same token while the first is open.
  grpc::Status s = Append({Message("second", rows, 0, "dup")});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << Describe(s);
  v1::Sequence seq;
  EXPECT_EQ(GetSequence("second", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
  // Two commits of the one stream: the first takes the token.
  auto release = BlockWorker();
  v1::AppendResponse committed;
  std::future<grpc::Status> first = CommitLater("dup", 1, &committed);
  absl::SleepFor(absl::Milliseconds(100));
  s = Commit("dup", 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(s);
  release->Notify();
  s = first.get();
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(committed.rows_written(), 8u);
  writer->WritesDone();
  EXPECT_TRUE(writer->Finish().ok());
  // The token is free again once its stream has ended.
  v1::AppendResponse again;
  s = Append({Message("third", rows, 0, "dup")}, &again);
  ASSERT_TRUE(s.ok()) << Describe(s);
  Free("first");
  Free("third");
}

// Many streams at once, each ended by a random one of: CommitAppend before
// its last message, after it, its half-close alone, both at once, a cancel.
// Every committed stream holds exactly its rows; nothing else is left.
TEST_F(CommitAppendTest, ManyStreamsEndedEveryWayCommitExactlyAndLeakNothing) {
  Start();
  const Rows rows = RandomRows(12, 13);
  constexpr int kThreads = 4, kStreams = 40;
  std::atomic<int> committed{0}, failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 gen(100 + t);
      for (int i = 0; i < kStreams; ++i) {
        const std::string id = absl::StrCat("m-", t, "-", i);
        const int how = static_cast<int>(gen() % 5);
        grpc::ClientContext ctx;
        v1::AppendResponse resp;
        auto writer = stub().Append(&ctx, &resp);
        std::future<grpc::Status> commit;
        v1::AppendResponse by_call;
        for (int m = 0; m < 3; ++m) {
          if (how == 0 && m == 2) commit = CommitLater(id, 3, &by_call);
          writer->Write(Message(id, rows, m, id));
        }
        if (how == 1) commit = CommitLater(id, 3, &by_call);
        if (how == 3) {
          commit = CommitLater(id, 3, &by_call);
          writer->WritesDone();
        }
        if (how == 4) ctx.TryCancel();
        if (how == 0 || how == 1) {
          const grpc::Status s = commit.get();
          if (!s.ok() || by_call.rows_written() != 24u) ++failures;
        }
        if (how != 3 && how != 4) writer->WritesDone();
        const grpc::Status end = writer->Finish();
        if (how == 3) {
          // The half-close and the call race: the call either commits the
          // stream or finds it ended already -- never a second commit.
          const grpc::Status s = commit.get();
          if (!(s.ok() || s.error_code() == grpc::StatusCode::NOT_FOUND)) ++failures;
          if (s.ok() && by_call.SerializeAsString() != resp.SerializeAsString()) ++failures;
        }
        if (how == 4) {
          if (end.ok()) ++failures;  // cancelled before any commit could run
          continue;
        }
        if (!end.ok() || resp.rows_written() != 24u) ++failures;
        ++committed;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kStreams; ++i) {
      const std::string id = absl::StrCat("m-", t, "-", i);
      v1::Sequence seq;
      if (GetSequence(id, &seq).ok()) {
        EXPECT_EQ(seq.length(), 12u) << id;
        Free(id);
        --committed;
      }
    }
  }
  EXPECT_EQ(committed.load(), 0) << "a stream that answered OK is missing, or one that failed is there";
  ExpectNothingLeft("m-0-0");
}

}  // namespace
}  // namespace mlakv::server::testing
