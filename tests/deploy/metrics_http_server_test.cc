// MetricsHttpServer on a loopback port: GET /metrics, 404, 405, 400, 431,
// HEAD, stalled clients, prompt shutdown with a client connected.
#include "server/metrics_http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mlakv::server {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

int Connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// Sends `request` and reads until the server closes.
std::string Exchange(int port, const std::string& request) {
  int fd = Connect(port);
  if (fd < 0) return "connect failed";
  send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string out;
  char buf[4096];
  ssize_t r;
  while ((r = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(r));
  close(fd);
  return out;
}

class MetricsHttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MetricsHttpServer::Options o;
    o.listen = "127.0.0.1:0";
    o.render = [this] {
      ++renders_;
      return std::string("# HELP x_total x\n# TYPE x_total counter\nx_total 1\n");
    };
    o.max_request_bytes = 1024;
    o.io_timeout = absl::Milliseconds(300);
    auto s = MetricsHttpServer::Create(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    ASSERT_GT(server_->port(), 0);
  }
  std::atomic<int> renders_{0};
  std::unique_ptr<MetricsHttpServer> server_;
};

TEST_F(MetricsHttpServerTest, ServesMetricsWithTextFormatContentType) {
  std::string r = Exchange(server_->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(r, HasSubstr("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"));
  EXPECT_THAT(r, HasSubstr("Content-Length: 50\r\n"));
  EXPECT_THAT(r, HasSubstr("Connection: close\r\n"));
  EXPECT_THAT(r, testing::EndsWith("\r\n\r\n# HELP x_total x\n# TYPE x_total counter\nx_total 1\n"));
  EXPECT_EQ(renders_.load(), 1);
}

TEST_F(MetricsHttpServerTest, QueryStringIsIgnored) {
  EXPECT_THAT(Exchange(server_->port(), "GET /metrics?name[]=x HTTP/1.0\r\n\r\n"), StartsWith("HTTP/1.1 200 OK"));
}

TEST_F(MetricsHttpServerTest, HeadHasHeadersButNoBody) {
  std::string r = Exchange(server_->port(), "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(r, HasSubstr("Content-Length: 50\r\n"));
  EXPECT_THAT(r, testing::EndsWith("\r\n\r\n"));
}

TEST_F(MetricsHttpServerTest, OtherPathsAre404) {
  EXPECT_THAT(Exchange(server_->port(), "GET / HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 404 Not Found\r\n"));
  EXPECT_THAT(Exchange(server_->port(), "GET /metricsx HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 404"));
  EXPECT_EQ(renders_.load(), 0);
}

TEST_F(MetricsHttpServerTest, OtherMethodsAre405) {
  std::string r = Exchange(server_->port(), "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 405 Method Not Allowed\r\n"));
  EXPECT_THAT(r, HasSubstr("Allow: GET, HEAD\r\n"));
}

TEST_F(MetricsHttpServerTest, MalformedRequestLineIs400) {
  EXPECT_THAT(Exchange(server_->port(), "hello\r\n\r\n"), StartsWith("HTTP/1.1 400"));
  EXPECT_THAT(Exchange(server_->port(), "GET metrics HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 400"));
  EXPECT_THAT(Exchange(server_->port(), "GET /metrics SPDY/3\r\n\r\n"), StartsWith("HTTP/1.1 400"));
}

TEST_F(MetricsHttpServerTest, OversizedHeadIs431) {
  std::string big = "GET /metrics HTTP/1.1\r\nX-Pad: " + std::string(4000, 'a') + "\r\n\r\n";
  EXPECT_THAT(Exchange(server_->port(), big), StartsWith("HTTP/1.1 431"));
  EXPECT_EQ(renders_.load(), 0);
  // And the server still serves afterwards.
  EXPECT_THAT(Exchange(server_->port(), "GET /metrics HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 200"));
}

TEST_F(MetricsHttpServerTest, StalledClientIsDroppedAndOthersServed) {
  int stalled = Connect(server_->port());
  ASSERT_GE(stalled, 0);
  send(stalled, "GET /met", 8, MSG_NOSIGNAL);  // never finishes its request
  auto t0 = std::chrono::steady_clock::now();
  std::string r = Exchange(server_->port(), "GET /metrics HTTP/1.1\r\n\r\n");
  auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200"));
  EXPECT_LT(waited, std::chrono::seconds(3));  // io_timeout is 300 ms
  char c;
  EXPECT_EQ(recv(stalled, &c, 1, 0), 0);  // the server closed the stalled connection
  close(stalled);
}

TEST_F(MetricsHttpServerTest, ShutdownIsPromptWithAClientConnected) {
  MetricsHttpServer::Options o;
  o.listen = "127.0.0.1:0";
  o.render = [] { return std::string(); };
  o.io_timeout = absl::Seconds(60);
  auto s = MetricsHttpServer::Create(o);
  ASSERT_TRUE(s.ok()) << s.status();
  int fd = Connect((*s)->port());
  ASSERT_GE(fd, 0);
  send(fd, "GET /", 5, MSG_NOSIGNAL);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto t0 = std::chrono::steady_clock::now();
  (*s)->Shutdown();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  (*s)->Shutdown();  // idempotent
  int port = (*s)->port();
  s->reset();
  close(fd);
  EXPECT_EQ(Connect(port), -1) << "port still accepting after shutdown";
}

TEST(MetricsHttpServerCreate, RejectsBadAddresses) {
  MetricsHttpServer::Options o;
  o.render = [] { return std::string(); };
  o.listen = "no-port";
  EXPECT_EQ(MetricsHttpServer::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.listen = "127.0.0.1:http";
  EXPECT_EQ(MetricsHttpServer::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.listen = "127.0.0.1:0";
  o.render = nullptr;
  EXPECT_EQ(MetricsHttpServer::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MetricsHttpServerCreate, PortInUseIsAnError) {
  MetricsHttpServer::Options o;
  o.render = [] { return std::string(); };
  o.listen = "127.0.0.1:0";
  auto a = MetricsHttpServer::Create(o);
  ASSERT_TRUE(a.ok()) << a.status();
  o.listen = "127.0.0.1:" + std::to_string((*a)->port());
  auto b = MetricsHttpServer::Create(o);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kUnavailable) << b.status();
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("cannot listen on 127.0.0.1:"));
}

TEST(MetricsHttpServerCreate, ListensOnIpv6Loopback) {
  MetricsHttpServer::Options o;
  o.render = [] { return std::string(); };
  o.listen = "[::1]:0";
  auto s = MetricsHttpServer::Create(o);
  if (!s.ok()) GTEST_SKIP() << "no IPv6 loopback here: " << s.status();
  EXPECT_GT((*s)->port(), 0);
}

}  // namespace
}  // namespace mlakv::server
