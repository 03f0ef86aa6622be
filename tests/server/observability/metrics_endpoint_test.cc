// MetricsEndpoint (prometheus::Exposer) on loopback ports, spoken to over raw
// TCP: what the Exposer answers (content type, its own exposer_* series,
// gzip, methods and paths it does not serve, oversized heads), clients that
// stall or drip their request (slowloris) while scrapes go on, concurrent
// scrapes, shutdown (prompt when no client is stalled mid-request, bounded
// by civetweb's 2 s poll quantum when one is), a port in use (also against a
// listener with SO_REUSEPORT), bad addresses, expired and throwing
// collectables.
#include "server/observability/metrics_endpoint.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <zlib.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/metric_family.h"

namespace mlakv::server {
namespace {

using ::testing::AllOf;
using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;
using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A Collectable whose Collect() is a function (counts its calls).
class FakeCollectable : public prometheus::Collectable {
 public:
  explicit FakeCollectable(std::function<std::vector<prometheus::MetricFamily>()> collect)
      : collect_(std::move(collect)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    ++calls_;
    return collect_();
  }
  int calls() const { return calls_.load(); }

 private:
  std::function<std::vector<prometheus::MetricFamily>()> collect_;
  mutable std::atomic<int> calls_{0};
};

std::vector<prometheus::MetricFamily> OneCounter() {
  prometheus::MetricFamily f;
  f.name = "x_total";
  f.help = "x";
  f.type = prometheus::MetricType::Counter;
  prometheus::ClientMetric m;
  m.label = {{"pool", "default"}};
  m.counter.value = 3;
  f.metric.push_back(m);
  return {f};
}
constexpr char kOneCounterText[] = "# HELP x_total x\n# TYPE x_total counter\nx_total{pool=\"default\"} 3\n";

int Connect(int port, int family = AF_INET) {
  int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_storage ss{};
  socklen_t len = 0;
  if (family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(static_cast<uint16_t>(port));
    a->sin6_addr = in6addr_loopback;
    len = sizeof(*a);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    a->sin_port = htons(static_cast<uint16_t>(port));
    a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    len = sizeof(*a);
  }
  if (connect(fd, reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    close(fd);
    return -1;
  }
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

std::string ReadUntilClosed(int fd) {
  std::string out;
  char buf[4096];
  ssize_t r;
  while ((r = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(r));
  return out;
}

// Sends `request` on a new connection and reads until the server closes.
std::string Exchange(int port, const std::string& request, int family = AF_INET) {
  int fd = Connect(port, family);
  if (fd < 0) return "connect failed";
  send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string out = ReadUntilClosed(fd);
  close(fd);
  return out;
}

std::string Scrape(int port) { return Exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"); }

// The part of a response after its head.
std::string BodyOf(const std::string& response) {
  const size_t end = response.find("\r\n\r\n");
  return end == std::string::npos ? "" : response.substr(end + 4);
}

std::string Gunzip(const std::string& in) {
  z_stream zs{};
  if (inflateInit2(&zs, 16 + MAX_WBITS) != Z_OK) return "inflateInit2 failed";
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  zs.avail_in = static_cast<uInt>(in.size());
  std::string out;
  char buf[16384];
  int ret = Z_OK;
  while (ret == Z_OK) {
    zs.next_out = reinterpret_cast<Bytef*>(buf);
    zs.avail_out = sizeof(buf);
    ret = inflate(&zs, Z_NO_FLUSH);
    out.append(buf, sizeof(buf) - zs.avail_out);
  }
  inflateEnd(&zs);
  return ret == Z_STREAM_END ? out : "not a whole gzip stream";
}

// Connections that send part of a request head and then nothing.
std::vector<int> StalledClients(int port, int n) {
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    int fd = Connect(port);
    if (fd < 0) continue;
    send(fd, "GET /metrics HTTP/1.1\r\nHost: x\r\n", 32, MSG_NOSIGNAL);  // no blank line: never complete
    fds.push_back(fd);
  }
  return fds;
}

// True while the server has neither sent anything nor closed `fd`.
bool StillOpen(int fd) {
  char c;
  ssize_t r = recv(fd, &c, 1, MSG_DONTWAIT);
  return r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

void CloseAll(const std::vector<int>& fds) {
  for (int fd : fds) close(fd);
}

MetricsEndpoint::Options Listen(const std::string& listen,
                                std::vector<std::weak_ptr<prometheus::Collectable>> collectables = {}) {
  MetricsEndpoint::Options o;
  o.listen = listen;
  o.collectables = std::move(collectables);
  return o;
}

class MetricsEndpointTest : public ::testing::Test {
 protected:
  // An endpoint on 127.0.0.1:0 serving `collectable_` (default options
  // unless changed before Start).
  void Start() {
    options_.listen = options_.listen.empty() ? "127.0.0.1:0" : options_.listen;
    options_.collectables = {collectable_};
    auto e = MetricsEndpoint::Create(options_);
    ASSERT_TRUE(e.ok()) << e.status();
    endpoint_ = std::move(*e);
    ASSERT_GT(endpoint_->port(), 0);
  }
  int port() const { return endpoint_->port(); }

  std::shared_ptr<FakeCollectable> collectable_ = std::make_shared<FakeCollectable>(OneCounter);
  MetricsEndpoint::Options options_;
  std::unique_ptr<MetricsEndpoint> endpoint_;
};

// The Exposer's answer: its content type (no version parameter, which
// Prometheus reads as the text format 0.0.4), its own series first, then the
// collectables; Content-Length is the body's.
TEST_F(MetricsEndpointTest, ServesTheTextFormatAfterTheExposersOwnSeries) {
  Start();
  const std::string r = Scrape(port());
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(r, HasSubstr("Content-Type: text/plain; charset=utf-8\r\n"));
  EXPECT_THAT(r, Not(HasSubstr("version=")));
  const std::string body = BodyOf(r);
  EXPECT_THAT(r, HasSubstr("Content-Length: " + std::to_string(body.size()) + "\r\n"));
  EXPECT_THAT(body, StartsWith("# HELP exposer_transferred_bytes_total "));
  EXPECT_THAT(body, HasSubstr("# TYPE exposer_scrapes_total counter\n"));
  EXPECT_THAT(body, HasSubstr("# TYPE exposer_request_latencies summary\n"));
  EXPECT_THAT(body, EndsWith(kOneCounterText));
  EXPECT_EQ(collectable_->calls(), 1);
}

// The Exposer adds its /metrics handler with the first collectable; the
// endpoint sees to it that one without collectables answers too.
TEST(MetricsEndpointCreate, WithoutCollectablesServesTheExposersSeries) {
  auto e = MetricsEndpoint::Create(Listen("127.0.0.1:0"));
  ASSERT_TRUE(e.ok()) << e.status();
  const std::string r = Scrape((*e)->port());
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(BodyOf(r), HasSubstr("\nexposer_scrapes_total 0\n"));
}

TEST_F(MetricsEndpointTest, ExposerCountsItsScrapes) {
  Start();
  Scrape(port());
  Scrape(port());
  // Counted after each response is written: the third scrape sees two.
  EXPECT_THAT(BodyOf(Scrape(port())), HasSubstr("\nexposer_scrapes_total 2\n"));
}

TEST_F(MetricsEndpointTest, GzipsWhenTheClientAcceptsIt) {
  Start();
  const std::string r = Exchange(port(), "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n");
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(r, HasSubstr("Content-Encoding: gzip\r\n"));
  const std::string body = BodyOf(r);
  EXPECT_THAT(r, HasSubstr("Content-Length: " + std::to_string(body.size()) + "\r\n"));
  EXPECT_THAT(Gunzip(body), EndsWith(kOneCounterText));
}

TEST_F(MetricsEndpointTest, QueryStringIsIgnored) {
  Start();
  // The Exposer writes "HTTP/1.1" whatever the request's version.
  EXPECT_THAT(Exchange(port(), "GET /metrics?name[]=x HTTP/1.0\r\n\r\n"), StartsWith("HTTP/1.1 200 OK"));
}

// The Exposer handles GET only; civetweb answers the rest as a file server
// without a document root would.
TEST_F(MetricsEndpointTest, OtherMethodsAreNotServed) {
  Start();
  for (const char* method : {"HEAD", "POST", "OPTIONS"}) {
    std::string r = Exchange(port(), std::string(method) + " /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
    EXPECT_THAT(r, StartsWith("HTTP/1.1 404 Not Found\r\n")) << method;
  }
  for (const char* method : {"PUT", "DELETE", "PATCH"}) {
    std::string r = Exchange(port(), std::string(method) + " /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
    EXPECT_THAT(r, StartsWith("HTTP/1.1 405 Method Not Allowed\r\n")) << method;
  }
  EXPECT_EQ(collectable_->calls(), 0);
}

// civetweb hands every path that begins with the handler's URI to it.
TEST_F(MetricsEndpointTest, PathsBeginningWithMetricsAreServedOthersAre404) {
  Start();
  for (const char* path : {"/metrics/x", "/metricsx"}) {
    EXPECT_THAT(Exchange(port(), std::string("GET ") + path + " HTTP/1.1\r\nHost: x\r\n\r\n"),
                AllOf(StartsWith("HTTP/1.1 200 OK"), EndsWith(kOneCounterText)))
        << path;
  }
  EXPECT_EQ(collectable_->calls(), 2);
  for (const char* path : {"/", "/index.html", "/../etc/passwd", "/metric"}) {
    EXPECT_THAT(Exchange(port(), std::string("GET ") + path + " HTTP/1.1\r\nHost: x\r\n\r\n"),
                StartsWith("HTTP/1.1 404"))
        << path;
  }
  EXPECT_EQ(collectable_->calls(), 2);
}

TEST_F(MetricsEndpointTest, OversizedRequestHeadIsRefusedAndServingGoesOn) {
  Start();
  std::string big = "GET /metrics HTTP/1.1\r\nX-Pad: " + std::string(16000, 'a') + "\r\n\r\n";
  std::string r = Exchange(port(), big);
  EXPECT_THAT(r, StartsWith("HTTP/1.0 400 Bad Request")) << r.substr(0, 200);
  EXPECT_EQ(collectable_->calls(), 0);
  EXPECT_THAT(Scrape(port()), StartsWith("HTTP/1.1 200"));
}

TEST_F(MetricsEndpointTest, MalformedRequestIsRefused) {
  Start();
  EXPECT_THAT(Exchange(port(), "hello\r\n\r\n"), StartsWith("HTTP/1.0 400 Bad Request"));
  EXPECT_EQ(collectable_->calls(), 0);
}

// Slowloris: connections that send part of a request head and stall hold a
// worker each; with fewer of them than workers, scrapes on other
// connections are answered at once, again and again, while they stay open.
TEST_F(MetricsEndpointTest, StalledClientsDoNotDelayScrapes) {
  Start();  // the defaults: 4 workers, 5 s request timeout
  std::vector<int> stalled = StalledClients(port(), 3);
  ASSERT_EQ(stalled.size(), 3u);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // each one is now in a worker's read
  for (int i = 0; i < 5; ++i) {
    const Clock::time_point t0 = Clock::now();
    std::string r = Scrape(port());
    const double took = SecondsSince(t0);
    EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK"));
    EXPECT_LT(took, 0.5) << "scrape " << i << " waited behind the stalled connections";
  }
  for (int fd : stalled) EXPECT_TRUE(StillOpen(fd)) << "the stalled connections were to stay open meanwhile";
  CloseAll(stalled);
}

// The same with more workers: a dozen stalled connections, scrapes unaffected.
TEST_F(MetricsEndpointTest, MoreWorkersTolerateMoreStalledClients) {
  options_.num_threads = 16;
  Start();
  std::vector<int> stalled = StalledClients(port(), 12);
  ASSERT_EQ(stalled.size(), 12u);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const Clock::time_point t0 = Clock::now();
  EXPECT_THAT(Scrape(port()), StartsWith("HTTP/1.1 200 OK"));
  EXPECT_LT(SecondsSince(t0), 0.5);
  CloseAll(stalled);
}

// The bound when every worker is held: a scrape waits only until the first
// stalled connection reaches its request timeout and is dropped.
TEST_F(MetricsEndpointTest, StalledClientsHoldingEveryWorkerDelayAScrapeOnlyUntilTheirTimeout) {
  options_.num_threads = 2;
  options_.request_timeout = absl::Milliseconds(600);
  Start();
  std::vector<int> stalled = StalledClients(port(), 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const Clock::time_point t0 = Clock::now();
  EXPECT_THAT(Scrape(port()), StartsWith("HTTP/1.1 200 OK"));
  const double took = SecondsSince(t0);
  EXPECT_GT(took, 0.3) << "both workers were held: the scrape had to wait";
  EXPECT_LT(took, 2.0) << "the request timeout (0.6 s) did not free a worker";
  for (int fd : stalled) EXPECT_EQ(ReadUntilClosed(fd).find("HTTP/1.1 200"), std::string::npos);
  CloseAll(stalled);
}

TEST_F(MetricsEndpointTest, StalledClientIsDroppedAfterTheRequestTimeout) {
  options_.request_timeout = absl::Milliseconds(300);
  Start();
  std::vector<int> stalled = StalledClients(port(), 1);
  ASSERT_EQ(stalled.size(), 1u);
  const Clock::time_point t0 = Clock::now();
  std::string got = ReadUntilClosed(stalled[0]);  // returns when the server closes (10 s receive timeout)
  const double took = SecondsSince(t0);
  EXPECT_GT(took, 0.2);
  EXPECT_LT(took, 2.0) << "a stalled connection outlived its 0.3 s request timeout";
  EXPECT_THAT(got, Not(HasSubstr("200 OK")));
  CloseAll(stalled);
}

// A client that keeps sending a byte at a time never lets a read time out;
// the request timeout counts from accept, so it is dropped all the same.
TEST_F(MetricsEndpointTest, DrippingClientIsDroppedAtTheRequestTimeout) {
  options_.request_timeout = absl::Milliseconds(500);
  Start();
  int fd = Connect(port());
  ASSERT_GE(fd, 0);
  const Clock::time_point t0 = Clock::now();
  bool dropped = false;
  for (int i = 0; i < 50 && !dropped; ++i) {  // 5 s of drip at most
    if (send(fd, "X", 1, MSG_NOSIGNAL) != 1) dropped = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    char c;
    ssize_t r = recv(fd, &c, 1, MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) dropped = true;
  }
  const double took = SecondsSince(t0);
  EXPECT_TRUE(dropped) << "a client dripping one byte per 100 ms was served for 5 s";
  EXPECT_LT(took, 2.5);
  close(fd);
}

// Many scrapes at once from several connections: every one is answered in
// full, each with its own collection.
TEST_F(MetricsEndpointTest, ParallelScrapesAreAllAnswered) {
  Start();
  const Clock::time_point t0 = Clock::now();
  std::vector<std::future<int>> clients;
  for (int c = 0; c < 8; ++c) {
    clients.push_back(std::async(std::launch::async, [this] {
      int good = 0;
      for (int i = 0; i < 25; ++i) {
        const std::string r = Scrape(port());
        if (r.starts_with("HTTP/1.1 200 OK\r\n") && r.ends_with(kOneCounterText)) ++good;
      }
      return good;
    }));
  }
  int good = 0;
  for (auto& c : clients) good += c.get();
  EXPECT_EQ(good, 200);
  EXPECT_EQ(collectable_->calls(), 200);
  EXPECT_LT(SecondsSince(t0), 5.0);
}

// What the Exposer does not do in parallel: it calls the collectables under
// one mutex, so two scrapes' collections run one after the other (sending
// and serializing do run on the workers at once). docs/deploy.md says so;
// this pins it. ServerMetrics' collectables take well under a millisecond.
TEST_F(MetricsEndpointTest, TheExposerCollectsOneScrapeAtATime) {
  std::atomic<int> inside{0}, most{0};
  collectable_ = std::make_shared<FakeCollectable>([&] {
    const int now = ++inside;
    for (int seen = most.load(); now > seen && !most.compare_exchange_weak(seen, now);) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    --inside;
    return OneCounter();
  });
  Start();
  const Clock::time_point t0 = Clock::now();
  std::vector<std::future<std::string>> scrapes;
  for (int i = 0; i < 4; ++i) scrapes.push_back(std::async(std::launch::async, [this] { return Scrape(port()); }));
  for (auto& s : scrapes) EXPECT_THAT(s.get(), EndsWith(kOneCounterText));
  EXPECT_EQ(most.load(), 1);
  EXPECT_GE(SecondsSince(t0), 0.55);
}

// Documented in metrics_endpoint.h: nothing between a collectable and
// civetweb's C code catches, so a throwing collectable ends the process
// (which is why ServerMetrics' collectables must not throw).
TEST(MetricsEndpointDeathTest, ThrowingCollectableEndsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto throwing = std::make_shared<FakeCollectable>([]() -> std::vector<prometheus::MetricFamily> {
          throw std::runtime_error("source broke");
        });
        auto e = MetricsEndpoint::Create(Listen("127.0.0.1:0", {throwing}));
        if (e.ok()) Scrape((*e)->port());
        std::fprintf(stderr, "still alive\n");
        std::exit(0);
      },
      "terminate called after throwing an instance of 'std::runtime_error'");
}

TEST_F(MetricsEndpointTest, ExpiredCollectablesAreSkipped) {
  Start();
  collectable_.reset();
  const std::string r = Scrape(port());
  EXPECT_THAT(r, StartsWith("HTTP/1.1 200 OK"));
  EXPECT_THAT(BodyOf(r), HasSubstr("exposer_scrapes_total"));
  EXPECT_THAT(r, Not(HasSubstr("x_total")));
}

// civetweb's acceptor checks its stop flag only every 2 s; Shutdown wakes it.
// Created and stopped at different points of that 2 s cycle.
TEST_F(MetricsEndpointTest, ShutdownIsPromptWhenIdle) {
  for (int i = 0; i < 4; ++i) {
    auto e = MetricsEndpoint::Create(Listen("127.0.0.1:0"));
    ASSERT_TRUE(e.ok()) << e.status();
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + 450 * i));
    const Clock::time_point t0 = Clock::now();
    (*e)->Shutdown();
    EXPECT_LT(SecondsSince(t0), 0.3) << "after " << 50 + 450 * i << " ms";
  }
}

// Clients that sent whole requests (and one that connected and closed) do
// not hold the stop up; the port is closed afterwards.
TEST_F(MetricsEndpointTest, ShutdownIsPromptAfterScrapes) {
  Start();
  for (int i = 0; i < 5; ++i) EXPECT_THAT(Scrape(port()), EndsWith(kOneCounterText));
  close(Connect(port()));
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  const Clock::time_point t0 = Clock::now();
  endpoint_->Shutdown();
  EXPECT_LT(SecondsSince(t0), 0.3);
  const Clock::time_point t1 = Clock::now();
  endpoint_->Shutdown();  // idempotent
  EXPECT_LT(SecondsSince(t1), 0.1);
  EXPECT_EQ(Connect(port()), -1) << "port still accepting after Shutdown";
}

// A wildcard address: Shutdown's wake-up connects to loopback instead.
TEST_F(MetricsEndpointTest, ShutdownIsPromptOnAWildcardAddress) {
  options_.listen = "0.0.0.0:0";
  Start();
  EXPECT_THAT(Scrape(port()), EndsWith(kOneCounterText));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const Clock::time_point t0 = Clock::now();
  endpoint_.reset();
  EXPECT_LT(SecondsSince(t0), 0.3);
}

// The limit of the wake-up: a worker polling a client stalled mid-request
// sees the stop flag only when its poll quantum (2 s) ends. Shutdown then
// takes up to those 2 s, never the request timeout (60 s here); the stalled
// connections are closed unanswered.
TEST_F(MetricsEndpointTest, ShutdownWithStalledClientsIsBoundedByThePollQuantum) {
  options_.request_timeout = absl::Seconds(60);
  Start();
  std::vector<int> stalled = StalledClients(port(), 3);
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  const Clock::time_point t0 = Clock::now();
  endpoint_->Shutdown();
  const double took = SecondsSince(t0);
  EXPECT_LT(took, 2.6) << "Shutdown waited for more than civetweb's 2 s poll quantum";
  std::printf("Shutdown with 3 stalled clients took %.3f s\n", took);
  for (int fd : stalled) EXPECT_EQ(ReadUntilClosed(fd), "") << "a stalled connection is closed, unanswered";
  CloseAll(stalled);
  EXPECT_EQ(Connect(port()), -1) << "port still accepting after Shutdown";
}

TEST(MetricsEndpointCreate, PortInUseIsAnError) {
  auto a = MetricsEndpoint::Create(Listen("127.0.0.1:0"));
  ASSERT_TRUE(a.ok()) << a.status();
  const std::string taken = "127.0.0.1:" + std::to_string((*a)->port());
  auto b = MetricsEndpoint::Create(Listen(taken));
  ASSERT_FALSE(b.ok()) << "a second endpoint bound " << taken;
  EXPECT_EQ(b.status().code(), absl::StatusCode::kUnavailable) << b.status();
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("cannot listen on '" + taken + "'"));
  EXPECT_THAT(Scrape((*a)->port()), StartsWith("HTTP/1.1 200"));  // the first one is unaffected
}

// SO_REUSEPORT lets a second socket bind a port only if both set it. A
// listener that sets it (as gRPC does by default) must still keep civetweb
// out: civetweb does not set it, so it cannot take a share of the port.
TEST(MetricsEndpointCreate, DoesNotSharePortsThroughSoReuseport) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ASSERT_EQ(setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one)), 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const std::string taken = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  auto e = MetricsEndpoint::Create(Listen(taken));
  EXPECT_FALSE(e.ok()) << "civetweb bound " << taken << " alongside an SO_REUSEPORT listener";
  close(fd);
}

TEST(MetricsEndpointCreate, RejectsBadOptions) {
  for (const char* listen : {"no-port", "127.0.0.1:http", "127.0.0.1:", "127.0.0.1:99999", "127.0.0.1:9090s",
                             "127.0.0.1:80,443", "no.such.host.invalid:9090"}) {
    auto e = MetricsEndpoint::Create(Listen(listen));
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << listen << ": " << e.status();
  }
  MetricsEndpoint::Options o = Listen("127.0.0.1:0");
  o.num_threads = 0;
  EXPECT_EQ(MetricsEndpoint::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Listen("127.0.0.1:0");
  o.request_timeout = absl::ZeroDuration();
  EXPECT_EQ(MetricsEndpoint::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MetricsEndpointCreate, AddressNotOnThisHostIsUnavailable) {
  auto e = MetricsEndpoint::Create(Listen("192.0.2.1:0"));  // TEST-NET-1: never a local address
  EXPECT_EQ(e.status().code(), absl::StatusCode::kUnavailable) << e.status();
}

TEST(MetricsEndpointCreate, ListensOnIpv6Loopback) {
  auto collectable = std::make_shared<FakeCollectable>(OneCounter);
  auto e = MetricsEndpoint::Create(Listen("[::1]:0", {collectable}));
  if (!e.ok()) GTEST_SKIP() << "no IPv6 loopback (or civetweb without IPv6) here: " << e.status();
  EXPECT_THAT(Exchange((*e)->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", AF_INET6), HasSubstr(kOneCounterText));
  const Clock::time_point t0 = Clock::now();
  e->reset();
  EXPECT_LT(SecondsSince(t0), 0.5);
}

}  // namespace
}  // namespace mlakv::server
