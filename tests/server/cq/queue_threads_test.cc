// QueueThreads' polling over a real server on loopback with four threads and
// a test unary method (Health/Check's messages) whose handler can block:
//  * quiet (fewer than two calls in progress), one thread polls: while a
//    handler blocks without passing its turn, a second call is not even read
//    (it runs past its deadline);
//  * a handler that calls LetAnotherPoll() before blocking lets another
//    thread poll: the second call is answered meanwhile;
//  * busy (two calls in progress), every thread polls: the second call is
//    answered beside a handler that blocks without passing its turn, and
//    back to quiet, one thread polls again.
// And the counting itself: server streams do not count, unary calls do,
// until their object is gone.
#include "server/cq/queue_threads.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "server/cq/calls.h"
#include "tests/server/cq/cq_test_server.h"

namespace mlakv::server::cq {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using TestCall = UnaryCall<HealthCheckRequest, HealthCheckResponse>;

constexpr int kThreads = 4;

// Check with service "block" waits for release_ (after LetAnotherPoll when
// pass_turn_ is set); any other answers SERVING at once.
class BlockingCheck {
 public:
  grpc::Service* service() { return &service_; }

  void Serve(QueueThreads* queue) {
    grpc::ServerCompletionQueue* cq = queue->queue();
    method_.request = [this, cq](grpc::ServerContext* ctx, HealthCheckRequest* req,
                                 grpc::ServerAsyncResponseWriter<HealthCheckResponse>* responder, void* tag) {
      service_.RequestCheck(ctx, req, responder, cq, cq, tag);
    };
    method_.handle = [this](TestCall* call) {
      if (call->request().service() == "block") {
        if (pass_turn_) QueueThreads::LetAnotherPoll();
        absl::MutexLock lock(&mu_);
        ++blocked_;
        mu_.Await(absl::Condition(&released_));
      }
      call->response()->set_status(HealthCheckResponse::SERVING);
      call->Finish(grpc::Status::OK);
    };
    TestCall::Serve(queue, &method_);
  }

  // Waits until `n` handlers have blocked so far.
  bool WaitBlocked(int n) {
    absl::MutexLock lock(&mu_);
    auto reached = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return blocked_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(10));
  }
  void SetReleased(bool released) {
    absl::MutexLock lock(&mu_);
    released_ = released;
  }

  bool pass_turn_ = false;

 private:
  grpc::health::v1::Health::AsyncService service_;
  TestCall::Method method_;
  absl::Mutex mu_;
  int blocked_ ABSL_GUARDED_BY(mu_) = 0;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
};

class QueueThreadsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<testing::CqTestServer>(std::vector<grpc::Service*>{check_.service()}, kThreads);
    ASSERT_TRUE(server_->started());
    check_.Serve(server_->threads());
    stub_ = grpc::health::v1::Health::NewStub(server_->channel());
  }

  void TearDown() override {
    check_.SetReleased(true);
    if (blocker_.joinable()) blocker_.join();
    server_->Stop();
    EXPECT_EQ(server_->threads()->calls_alive(), 0);
  }

  grpc::Status Check(const std::string& service, std::chrono::milliseconds deadline) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + deadline);
    HealthCheckRequest req;
    req.set_service(service);
    HealthCheckResponse resp;
    return stub_->Check(&ctx, req, &resp);
  }

  // A call counts as in progress until its object is deleted, which may come
  // a little after its client has the answer.
  void WaitForNoCallInProgress() {
    const QueueThreads* q = server_->threads();
    for (int i = 0; i < 1000 && q->calls_in_progress() != 0; ++i) absl::SleepFor(absl::Milliseconds(10));
    ASSERT_EQ(q->calls_in_progress(), 0);
  }

  // A "block" call on its own thread, returned once its handler blocks.
  void StartBlockedCall() {
    check_.SetReleased(false);
    blocker_ = std::thread([this] { blocked_status_ = Check("block", std::chrono::seconds(30)); });
    ASSERT_TRUE(check_.WaitBlocked(++blocks_));
  }
  void ReleaseBlockedCall() {
    check_.SetReleased(true);
    blocker_.join();
    EXPECT_TRUE(blocked_status_.ok()) << blocked_status_.error_message();
  }

  BlockingCheck check_;
  std::unique_ptr<testing::CqTestServer> server_;
  std::unique_ptr<grpc::health::v1::Health::Stub> stub_;
  std::thread blocker_;
  grpc::Status blocked_status_;
  int blocks_ = 0;
};

TEST_F(QueueThreadsTest, QuietOneThreadPollsSoABlockedHandlerHoldsBackTheNextCall) {
  ASSERT_TRUE(Check("", std::chrono::seconds(10)).ok());  // the channel is connected
  WaitForNoCallInProgress();
  EXPECT_EQ(server_->threads()->pollers_allowed(), 1);
  StartBlockedCall();
  EXPECT_EQ(Check("", std::chrono::milliseconds(300)).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ReleaseBlockedCall();
  EXPECT_TRUE(Check("", std::chrono::seconds(10)).ok());
}

TEST_F(QueueThreadsTest, AHandlerThatPassesItsTurnLetsTheNextCallThrough) {
  check_.pass_turn_ = true;
  ASSERT_TRUE(Check("", std::chrono::seconds(10)).ok());
  StartBlockedCall();
  const grpc::Status s = Check("", std::chrono::seconds(10));
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(QueueThreadsTest, BusyEveryThreadPollsThenQuietAgain) {
  ASSERT_TRUE(Check("", std::chrono::seconds(10)).ok());
  QueueThreads* q = server_->threads();
  WaitForNoCallInProgress();
  // Two calls in progress, as two Append streams would be.
  q->CallBusy();
  EXPECT_EQ(q->pollers_allowed(), 1);
  q->CallBusy();
  EXPECT_EQ(q->pollers_allowed(), kThreads);
  StartBlockedCall();  // a third call in progress, its thread held
  for (int i = 0; i < 20; ++i) {
    const grpc::Status s = Check("", std::chrono::seconds(10));
    ASSERT_TRUE(s.ok()) << i << ": " << s.error_message();
  }
  EXPECT_GT(q->pollers(), 1);
  ReleaseBlockedCall();
  q->CallIdle();
  q->CallIdle();
  WaitForNoCallInProgress();
  EXPECT_EQ(q->pollers_allowed(), 1);
  // The extra pollers leave after their next event; then one polls again
  // and a blocked handler holds back the next call once more.
  for (int i = 0; i < 200 && q->pollers() > 1; ++i) ASSERT_TRUE(Check("", std::chrono::seconds(10)).ok());
  EXPECT_EQ(q->pollers(), 1);
  StartBlockedCall();
  EXPECT_EQ(Check("", std::chrono::milliseconds(300)).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ReleaseBlockedCall();
}

}  // namespace
}  // namespace mlakv::server::cq
