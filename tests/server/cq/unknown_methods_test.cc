// UnknownMethods over a real server on loopback with four queue threads:
// a call of an unknown method, of an unknown method of a served service, and
// a client stream to one, each get UNIMPLEMENTED naming the path (escaped,
// bounded) and what is served; the served service still answers beside it;
// a burst of thousands of unknown calls, many in flight at once, all get
// their answer (gRPC 1.51's own answer for such calls handed null tags to a
// multi-threaded queue and crashed the process: cq/unknown_methods.h); and
// every call object is gone after the server stops.
#include "server/cq/unknown_methods.h"

#include <grpcpp/generic/generic_stub.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "server/cq/health_service.h"
#include "tests/server/cq/cq_test_server.h"

namespace mlakv::server::cq {
namespace {

using ::testing::HasSubstr;

class UnknownMethodsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<testing::CqTestServer>(std::vector<grpc::Service*>{health_.service()}, 4,
                                                      absl::ZeroDuration(), unknown_.service());
    ASSERT_TRUE(server_->started());
    health_.Serve(server_->threads());
    unknown_.Serve(server_->threads());
    health_.SetServing(true);
  }

  void TearDown() override {
    server_->Stop();
    EXPECT_EQ(server_->threads()->calls_alive(), 0);
  }

  // One unary call of `path` with an empty message, through the generic stub.
  grpc::Status CallPath(const std::string& path) {
    grpc::GenericStub stub(server_->channel());
    grpc::CompletionQueue cq;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Slice empty("");
    const grpc::ByteBuffer request(&empty, 1);
    grpc::ByteBuffer response;
    grpc::Status status;
    auto call = stub.PrepareUnaryCall(&ctx, path, request, &cq);
    call->StartCall();
    call->Finish(&response, &status, this);
    void* tag = nullptr;
    bool ok = false;
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(tag, this);
    return status;
  }

  HealthService health_{{"mlakv.v1.KvCache"}};
  UnknownMethods unknown_{"grpc.health.v1.Health"};
  std::unique_ptr<testing::CqTestServer> server_;
};

TEST_F(UnknownMethodsTest, UnknownServiceIsUnimplementedAndNamed) {
  const grpc::Status status = CallPath("/no.such.Service/Method");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(status.error_message(), HasSubstr("unknown method '/no.such.Service/Method'"));
  EXPECT_THAT(status.error_message(), HasSubstr("this server serves grpc.health.v1.Health"));
}

TEST_F(UnknownMethodsTest, UnknownMethodOfAServedService) {
  const grpc::Status status = CallPath("/grpc.health.v1.Health/Chek");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(status.error_message(), HasSubstr("'/grpc.health.v1.Health/Chek'"));
  // The served method beside it still answers.
  grpc::health::v1::HealthCheckResponse response;
  grpc::ClientContext ctx;
  auto stub = grpc::health::v1::Health::NewStub(server_->channel());
  ASSERT_TRUE(stub->Check(&ctx, {}, &response).ok());
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(UnknownMethodsTest, HostilePathIsQuotedEscapedAndBounded) {
  std::string path = "/evil'\\svc/";
  path += std::string(5000, 'x');
  const grpc::Status status = CallPath(path);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(status.error_message(), HasSubstr("'/evil\\'\\\\svc/xxx"));
  EXPECT_LT(status.error_message().size(), 1024u) << "the path's quote is not bounded";
  EXPECT_THAT(status.error_message(), HasSubstr("(5011 bytes)"));
}

TEST_F(UnknownMethodsTest, ClientStreamToAnUnknownMethodEnds) {
  grpc::GenericStub stub(server_->channel());
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto stream = stub.PrepareCall(&ctx, "/mlakv.v1.KvCache/Nope", &cq);
  void* tag = nullptr;
  bool ok = false;
  int tags[4];
  stream->StartCall(&tags[0]);
  ASSERT_TRUE(cq.Next(&tag, &ok));
  grpc::Slice bytes(std::string(100000, 'a'));
  stream->Write(grpc::ByteBuffer(&bytes, 1), &tags[1]);
  ASSERT_TRUE(cq.Next(&tag, &ok));  // may fail: the server ended the call already
  grpc::Status status;
  stream->Finish(&status, &tags[2]);
  ASSERT_TRUE(cq.Next(&tag, &ok));
  EXPECT_EQ(tag, &tags[2]);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(status.error_message(), HasSubstr("'/mlakv.v1.KvCache/Nope'"));
}

// 20,000 unknown calls, 256 in flight: each one answered UNIMPLEMENTED, and
// the process is still here (with gRPC's own unknown-method requests this
// crashed within the first few hundred calls on four threads).
TEST_F(UnknownMethodsTest, BurstOfUnknownCallsAllAnswered) {
  constexpr int kCalls = 20000;
  constexpr int kWindow = 256;
  grpc::GenericStub stub(server_->channel());
  grpc::CompletionQueue cq;
  struct Pending {
    grpc::ClientContext ctx;
    grpc::ByteBuffer response;
    grpc::Status status;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> rpc;
  };
  grpc::Slice empty("");
  const grpc::ByteBuffer request(&empty, 1);
  int started = 0;
  auto start = [&] {
    auto* p = new Pending;
    p->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    p->rpc = stub.PrepareUnaryCall(&p->ctx, "/x.Y/M" + std::to_string(started), request, &cq);
    p->rpc->StartCall();
    p->rpc->Finish(&p->response, &p->status, p);
    ++started;
  };
  for (int i = 0; i < kWindow; ++i) start();
  int unimplemented = 0;
  for (int done = 0; done < kCalls; ++done) {
    void* tag = nullptr;
    bool ok = false;
    ASSERT_TRUE(cq.Next(&tag, &ok));
    auto* p = static_cast<Pending*>(tag);
    if (p->status.error_code() == grpc::StatusCode::UNIMPLEMENTED) ++unimplemented;
    delete p;
    if (started < kCalls) start();
  }
  EXPECT_EQ(unimplemented, kCalls);
  cq.Shutdown();
}

}  // namespace
}  // namespace mlakv::server::cq
