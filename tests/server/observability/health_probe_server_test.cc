// HealthProbeServer: the plaintext probe port on its polled completion
// queue. Check and Watch of "" and mlakv.v1.KvCache follow SetServing; an
// unknown name is NOT_FOUND; nothing but Health is served (reflection is
// UNIMPLEMENTED); Shutdown says NOT_SERVING, ends an open Watch and returns.
#include "server/observability/health_probe_server.h"

#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"

namespace mlakv::server {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

class HealthProbeServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<HealthProbeServer>> probe = HealthProbeServer::Create("127.0.0.1:0");
    ASSERT_TRUE(probe.ok()) << probe.status();
    probe_ = std::move(*probe);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(probe_->port()), grpc::InsecureChannelCredentials());
    stub_ = Health::NewStub(channel_);
  }

  grpc::Status Check(const std::string& service, HealthCheckResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    HealthCheckRequest request;
    request.set_service(service);
    return stub_->Check(&ctx, request, response);
  }

  std::unique_ptr<HealthProbeServer> probe_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<Health::Stub> stub_;
};

TEST_F(HealthProbeServerTest, CheckFollowsSetServing) {
  for (const char* name : {"", "mlakv.v1.KvCache"}) {
    HealthCheckResponse response;
    ASSERT_TRUE(Check(name, &response).ok());
    EXPECT_EQ(response.status(), HealthCheckResponse::SERVING) << name;
  }
  probe_->SetServing(false);
  HealthCheckResponse response;
  ASSERT_TRUE(Check("mlakv.v1.KvCache", &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(Check("no.such.Service", &response).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(HealthProbeServerTest, ServesNothingButHealth) {
  auto reflection = grpc::reflection::v1::ServerReflection::NewStub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto stream = reflection->ServerReflectionInfo(&ctx);
  grpc::reflection::v1::ServerReflectionRequest request;
  request.set_list_services("");
  stream->Write(request);
  stream->WritesDone();
  grpc::reflection::v1::ServerReflectionResponse response;
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(HealthProbeServerTest, ShutdownEndsAnOpenWatch) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  HealthCheckRequest request;
  auto watch = stub_->Watch(&ctx, request);
  HealthCheckResponse response;
  ASSERT_TRUE(watch->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
  probe_->SetServing(false);
  ASSERT_TRUE(watch->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  probe_->SetServing(true);
  ASSERT_TRUE(watch->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);

  probe_->Shutdown();  // returns: the open watch was cancelled and its call ended
  // NOT_SERVING may or may not get out before the cancel; then the end.
  while (watch->Read(&response)) EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  EXPECT_FALSE(watch->Finish().ok());
  probe_->SetServing(true);  // ignored after Shutdown, and harmless
  probe_->Shutdown();        // idempotent
}

}  // namespace
}  // namespace mlakv::server
