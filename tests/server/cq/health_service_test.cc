// HealthService over a real server on loopback, its QueueThreads blocking
// in Next() and polled (the probe port's mode): Check of "", of a known and
// an unknown name; Watch's first status, its changes without repeats, the
// SERVICE_UNKNOWN stream that stays open; Shutdown() as final; the server's
// shutdown ending open watches with every call object gone; many watchers
// and checks while the status flips (label tsan).
#include "server/cq/health_service.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/server/cq/cq_test_server.h"

namespace mlakv::server::cq {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

constexpr char kKnown[] = "mlakv.v1.KvCache";

// Check and Watch are each waiting for their next call.
constexpr int kArmedCalls = 2;

class HealthServiceTest : public ::testing::TestWithParam<absl::Duration> {
 protected:
  void SetUp() override {
    server_ = std::make_unique<testing::CqTestServer>(std::vector<grpc::Service*>{health_.service()}, 2, GetParam());
    ASSERT_TRUE(server_->started());
    health_.Serve(server_->threads());
    stub_ = Health::NewStub(server_->channel());
  }

  void TearDown() override {
    server_->Stop();
    EXPECT_EQ(server_->threads()->calls_alive(), 0);
  }

  grpc::Status Check(const std::string& service, HealthCheckResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    HealthCheckRequest request;
    request.set_service(service);
    return stub_->Check(&ctx, request, response);
  }

  HealthCheckResponse::ServingStatus CheckStatus(const std::string& service) {
    HealthCheckResponse response;
    const grpc::Status status = Check(service, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.status();
  }

  // Waits until the queue's call objects are `count` (calls end on the
  // server a little after the client saw them end).
  bool CallsAliveReach(int count) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (server_->threads()->calls_alive() != count) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return true;
  }

  HealthService health_{{kKnown}};
  std::unique_ptr<testing::CqTestServer> server_;
  std::unique_ptr<Health::Stub> stub_;
};

// An open Watch stream.
struct Watcher {
  Watcher(Health::Stub* stub, const std::string& service,
          std::chrono::milliseconds timeout = std::chrono::milliseconds(20000)) {
    ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    HealthCheckRequest request;
    request.set_service(service);
    reader = stub->Watch(&ctx, request);
  }
  // The next status; UNKNOWN (0) when the stream ended.
  HealthCheckResponse::ServingStatus Next() {
    HealthCheckResponse response;
    if (!reader->Read(&response)) return HealthCheckResponse::UNKNOWN;
    return response.status();
  }
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader;
};

TEST_P(HealthServiceTest, CheckAnswersForTheServerAndKnownNames) {
  EXPECT_EQ(CheckStatus(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(CheckStatus(kKnown), HealthCheckResponse::SERVING);
  health_.SetServing(false);
  EXPECT_EQ(CheckStatus(""), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(CheckStatus(kKnown), HealthCheckResponse::NOT_SERVING);
  health_.SetServing(true);
  EXPECT_EQ(CheckStatus(kKnown), HealthCheckResponse::SERVING);
}

TEST_P(HealthServiceTest, CheckOfAnUnknownNameIsNotFound) {
  HealthCheckResponse response;
  const grpc::Status status = Check("no.such.Service", &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), "unknown service");
}

TEST_P(HealthServiceTest, WatchSendsTheStatusThenEachChangeOnce) {
  Watcher w(stub_.get(), "");
  EXPECT_EQ(w.Next(), HealthCheckResponse::SERVING);
  health_.SetServing(false);
  EXPECT_EQ(w.Next(), HealthCheckResponse::NOT_SERVING);
  // Equal to the last one sent: nothing goes out, so the next message is
  // the change that follows.
  health_.SetServing(false);
  health_.SetServing(true);
  EXPECT_EQ(w.Next(), HealthCheckResponse::SERVING);

  Watcher known(stub_.get(), kKnown);
  EXPECT_EQ(known.Next(), HealthCheckResponse::SERVING);
  health_.SetServing(false);
  EXPECT_EQ(known.Next(), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(w.Next(), HealthCheckResponse::NOT_SERVING);

  // The client's cancel ends the stream on both sides.
  w.ctx.TryCancel();
  known.ctx.TryCancel();
  EXPECT_EQ(w.reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(known.reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(CallsAliveReach(kArmedCalls));
}

TEST_P(HealthServiceTest, WatchOfAnUnknownNameSaysSoOnceAndStaysOpen) {
  Watcher w(stub_.get(), "no.such.Service", std::chrono::milliseconds(600));
  EXPECT_EQ(w.Next(), HealthCheckResponse::SERVICE_UNKNOWN);
  health_.SetServing(false);
  health_.SetServing(true);
  // Nothing more comes, and the stream stays open until the deadline.
  EXPECT_EQ(w.Next(), HealthCheckResponse::UNKNOWN);
  EXPECT_EQ(w.reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(CallsAliveReach(kArmedCalls));
}

TEST_P(HealthServiceTest, ShutdownIsNotServingForGood) {
  Watcher w(stub_.get(), kKnown);
  EXPECT_EQ(w.Next(), HealthCheckResponse::SERVING);
  health_.Shutdown();
  EXPECT_EQ(w.Next(), HealthCheckResponse::NOT_SERVING);
  health_.SetServing(true);
  EXPECT_EQ(CheckStatus(""), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(CheckStatus(kKnown), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(health_.Status(kKnown), HealthCheckResponse::NOT_SERVING);
  // A watch opened now starts NOT_SERVING.
  Watcher late(stub_.get(), "");
  EXPECT_EQ(late.Next(), HealthCheckResponse::NOT_SERVING);
  for (Watcher* x : {&w, &late}) {
    x->ctx.TryCancel();
    EXPECT_EQ(x->reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
}

TEST_P(HealthServiceTest, ServerShutdownEndsOpenWatches) {
  std::vector<std::unique_ptr<Watcher>> watchers;
  for (const char* name : {"", kKnown, "no.such.Service"}) {
    watchers.push_back(std::make_unique<Watcher>(stub_.get(), name));
    EXPECT_NE(watchers.back()->Next(), HealthCheckResponse::UNKNOWN);
  }
  EXPECT_TRUE(CallsAliveReach(kArmedCalls + 3));
  // Returns only once every call object is deleted: the watches were
  // cancelled, finished and done.
  server_->Stop();
  EXPECT_EQ(server_->threads()->calls_alive(), 0);
  for (auto& w : watchers) {
    EXPECT_EQ(w->Next(), HealthCheckResponse::UNKNOWN);
    EXPECT_FALSE(w->reader->Finish().ok());
  }
}

TEST_P(HealthServiceTest, ManyWatchersFollowTheStatusWhileChecksRun) {
  constexpr int kWatchers = 8;
  constexpr int kFlips = 200;
  struct Seen {
    absl::Mutex mu;
    std::vector<HealthCheckResponse::ServingStatus> statuses ABSL_GUARDED_BY(mu);
  };
  std::vector<std::unique_ptr<Watcher>> watchers;
  std::vector<std::unique_ptr<Seen>> seen;
  std::vector<std::thread> readers;
  for (int i = 0; i < kWatchers; ++i) {
    watchers.push_back(std::make_unique<Watcher>(stub_.get(), i % 2 == 0 ? "" : kKnown));
    seen.push_back(std::make_unique<Seen>());
    // The first status before the flips start: every watcher is registered.
    const HealthCheckResponse::ServingStatus first = watchers.back()->Next();
    ASSERT_EQ(first, HealthCheckResponse::SERVING);
    readers.emplace_back([w = watchers.back().get(), s = seen.back().get(), first] {
      {
        absl::MutexLock lock(&s->mu);
        s->statuses.push_back(first);
      }
      for (;;) {
        const HealthCheckResponse::ServingStatus status = w->Next();
        if (status == HealthCheckResponse::UNKNOWN) return;
        absl::MutexLock lock(&s->mu);
        s->statuses.push_back(status);
      }
    });
  }
  std::atomic<bool> flipping{true};
  std::atomic<int> checks_failed{0};
  std::vector<std::thread> checkers;
  for (int i = 0; i < 2; ++i) {
    checkers.emplace_back([&] {
      while (flipping.load()) {
        HealthCheckResponse response;
        if (!Check(kKnown, &response).ok() || (response.status() != HealthCheckResponse::SERVING &&
                                               response.status() != HealthCheckResponse::NOT_SERVING)) {
          ++checks_failed;
        }
      }
    });
  }
  for (int i = 0; i < kFlips; ++i) health_.SetServing(i % 2 == 0);  // ends on false
  flipping = false;
  for (std::thread& t : checkers) t.join();
  EXPECT_EQ(checks_failed.load(), 0);

  // Every watcher ends on the last status, and never hears one twice in a row.
  for (auto& s : seen) {
    absl::MutexLock lock(&s->mu);
    auto last_is_not_serving = [](std::vector<HealthCheckResponse::ServingStatus>* v) {
      return !v->empty() && v->back() == HealthCheckResponse::NOT_SERVING;
    };
    EXPECT_TRUE(s->mu.AwaitWithTimeout(absl::Condition(+last_is_not_serving, &s->statuses), absl::Seconds(10)));
    for (size_t i = 1; i < s->statuses.size(); ++i) EXPECT_NE(s->statuses[i], s->statuses[i - 1]) << i;
  }
  for (auto& w : watchers) w->ctx.TryCancel();
  for (std::thread& t : readers) t.join();
  for (auto& w : watchers) EXPECT_EQ(w->reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(CallsAliveReach(kArmedCalls));
}

INSTANTIATE_TEST_SUITE_P(Modes, HealthServiceTest,
                         ::testing::Values(absl::ZeroDuration(), absl::Milliseconds(20)),
                         [](const ::testing::TestParamInfo<absl::Duration>& info) {
                           return info.param == absl::ZeroDuration() ? std::string("Blocking")
                                                                     : std::string("Polled");
                         });

}  // namespace
}  // namespace mlakv::server::cq
