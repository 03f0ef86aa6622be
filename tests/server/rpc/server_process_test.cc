// ServerProcess: which step refuses which flags (and so which exit status
// main.cc gives), and that a started process serves gRPC, /metrics and the
// probe port, then stops in order.
#include "server/rpc/server_process.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"
#include "server/observability/malloc_library.h"
#include "server/rpc/server_config.h"

namespace mlakv::server {
namespace {

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

ServerFlags SmallServer() {
  ServerFlags flags;
  flags.config_path = WriteFile("server_process_test.txtpb",
                                "pools { name: \"p\" device: \"cpu\" num_layers: 2 page_size: 16 num_pages: 8 }\n");
  flags.listen = "127.0.0.1:0";
  flags.device = "cpu";
  flags.version = "test-version";
  return flags;
}

std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    const std::string request = "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    send(fd, request.data(), request.size(), MSG_NOSIGNAL);
    char buf[4096];
    ssize_t r;
    while ((r = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(r));
  }
  close(fd);
  return out;
}

TEST(PrepareServer, BadDeviceNamesTheFlag) {
  ServerFlags flags = SmallServer();
  flags.device = "tpu:0";
  absl::StatusOr<PreparedServer> p = PrepareServer(flags);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(p.status().message(), "--device: ")) << p.status();
}

TEST(PrepareServer, MissingConfigFileIsNamed) {
  ServerFlags flags = SmallServer();
  flags.config_path = "/nonexistent/mlakv.txtpb";
  absl::StatusOr<PreparedServer> p = PrepareServer(flags);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("/nonexistent/mlakv.txtpb"), absl::string_view::npos) << p.status();
}

TEST(PrepareServer, TokenWithoutTlsIsRefused) {
  ServerFlags flags = SmallServer();
  flags.auth_token_file = WriteFile("server_process_token", "secret\n");
  absl::StatusOr<PreparedServer> p = PrepareServer(flags);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("--auth_token_file needs --tls_cert"), absl::string_view::npos) << p.status();
}

TEST(PrepareServer, ListenFallsBackToTheConfigThenTheDefault) {
  ServerFlags flags = SmallServer();
  flags.listen.clear();
  absl::StatusOr<PreparedServer> p = PrepareServer(flags);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->listen, kDefaultListen);
  flags.config_path = WriteFile("server_process_listen.txtpb",
                                "listen: \"127.0.0.1:4\" pools { name: \"p\" device: \"cpu\" num_layers: 1 "
                                "page_size: 16 num_pages: 1 }\n");
  p = PrepareServer(flags);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->listen, "127.0.0.1:4");
  flags.listen = "127.0.0.1:5";
  p = PrepareServer(flags);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->listen, "127.0.0.1:5");
}

TEST(ServerProcess, ServesGrpcMetricsAndProbeThenDrains) {
  ServerFlags flags = SmallServer();
  flags.metrics_listen = "127.0.0.1:0";
  flags.health_listen = "127.0.0.1:0";
  absl::StatusOr<PreparedServer> prepared = PrepareServer(flags);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  absl::StatusOr<std::unique_ptr<ServerProcess>> process = ServerProcess::Start(std::move(*prepared));
  ASSERT_TRUE(process.ok()) << process.status();
  ServerProcess& p = **process;
  ASSERT_GT(p.server().bound_port(), 0);
  ASSERT_GT(p.metrics_port(), 0);
  ASSERT_GT(p.health_port(), 0);
  p.LogReady();

  auto stub = v1::KvCache::NewStub(
      grpc::CreateChannel(p.server().bound_address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::ListPoolsRequest req;
  v1::ListPoolsResponse resp;
  const grpc::Status listed = stub->ListPools(&ctx, req, &resp);
  ASSERT_TRUE(listed.ok()) << listed.error_code() << " " << listed.error_message();
  ASSERT_EQ(resp.pools_size(), 1) << resp.ShortDebugString();
  EXPECT_EQ(resp.pools(0).name(), "p");

  // Pool gauges are connected: the scrape reads the pool as it is now.
  const std::string scrape = HttpGet(p.metrics_port(), "/metrics");
  EXPECT_NE(scrape.find(absl::StrCat("mlakv_build_info{allocator=\"", MallocLibrary(), "\",version=\"test-version\"} 1")),
            std::string::npos) << scrape.substr(0, 2000);
  EXPECT_NE(scrape.find("mlakv_pool_pages_capacity{device=\"cpu\",pool=\"p\"} 8"), std::string::npos) << scrape.substr(0, 2000);
  EXPECT_NE(scrape.find("mlakv_draining 0"), std::string::npos) << scrape.substr(0, 2000);

  const int metrics_port = p.metrics_port();
  const std::string grpc_address = p.server().bound_address();
  p.Drain(absl::Seconds(1));
  // Every port is closed after the drain.
  EXPECT_EQ(HttpGet(metrics_port, "/metrics").substr(0, 500), "") << "port " << metrics_port;
  grpc::ClientContext late;
  late.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  resp.Clear();
  EXPECT_FALSE(stub->ListPools(&late, req, &resp).ok()) << grpc_address << " still answered "
                                                        << resp.ShortDebugString();
}

TEST(ServerProcess, PortInUseFailsStartAndLeavesNothingListening) {
  absl::StatusOr<PreparedServer> first_prepared = PrepareServer(SmallServer());
  ASSERT_TRUE(first_prepared.ok());
  absl::StatusOr<std::unique_ptr<ServerProcess>> first = ServerProcess::Start(std::move(*first_prepared));
  ASSERT_TRUE(first.ok()) << first.status();

  // The second one's gRPC port starts, its metrics port is the first one's gRPC port.
  ServerFlags flags = SmallServer();
  flags.metrics_listen = (*first)->server().bound_address();
  absl::StatusOr<PreparedServer> prepared = PrepareServer(flags);
  ASSERT_TRUE(prepared.ok());
  absl::StatusOr<std::unique_ptr<ServerProcess>> second = ServerProcess::Start(std::move(*prepared));
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(absl::StartsWith(second.status().message(), "--metrics_listen: ")) << second.status();

  ServerFlags same_port = SmallServer();
  same_port.listen = (*first)->server().bound_address();
  prepared = PrepareServer(same_port);
  ASSERT_TRUE(prepared.ok());
  second = ServerProcess::Start(std::move(*prepared));
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(absl::StartsWith(second.status().message(), "cannot start: ")) << second.status();
  (*first)->Drain(absl::Seconds(1));
}

}  // namespace
}  // namespace mlakv::server
