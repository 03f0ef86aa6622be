// ServerMetrics on prometheus-cpp: the metric set and its text, histogram
// buckets, gauges read at scrape time, and the label bounds — directly, and
// through a real KvCacheServer (interceptor, on_append): 20,000 calls
// with random method names leave /metrics small with every method label
// from the served set or "unknown"; appends naming pools that do not exist
// add no pool label.
#include "server/observability/server_metrics.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"
#include "server/rpc/kv_cache_server.h"
#include "server/observability/malloc_library.h"
#include "server/observability/rpc_method_set.h"
#include "spdlog/spdlog.h"
#include "tests/server/rpc/service_fixture.h"

namespace mlakv::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kKv[] = "mlakv.v1.KvCache";

// One sample line of the text format.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

std::vector<Sample> Parse(const std::string& text) {
  static const std::regex line_re(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$)");
  static const std::regex label_re(R"re(([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)")re");
  std::vector<Sample> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.empty() || line[0] == '#') continue;
    std::smatch m;
    if (!std::regex_match(line, m, line_re)) {
      ADD_FAILURE() << "unparsable sample line: " << line;
      continue;
    }
    Sample s{.name = m[1], .labels = {}, .value = std::stod(m[3])};
    const std::string labels = m[2];
    for (std::sregex_iterator it(labels.begin(), labels.end(), label_re), done; it != done; ++it) {
      s.labels[(*it)[1]] = (*it)[2];
    }
    out.push_back(std::move(s));
  }
  return out;
}

// The value of the sample `name` with exactly `labels`; 0 if absent.
double Value(const std::string& text, const std::string& name, const std::map<std::string, std::string>& labels = {}) {
  for (const Sample& s : Parse(text)) {
    if (s.name == name && s.labels == labels) return s.value;
  }
  return 0;
}

// Every value the label `label` takes in the text.
std::set<std::string> LabelValues(const std::string& text, const std::string& label) {
  std::set<std::string> out;
  for (const Sample& s : Parse(text)) {
    if (auto it = s.labels.find(label); it != s.labels.end()) out.insert(it->second);
  }
  return out;
}

std::unique_ptr<ServerMetrics> NewMetrics() {
  absl::StatusOr<std::unique_ptr<ServerMetrics>> m = ServerMetrics::Create("1.2.3");
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

TEST(RpcMethodSet, ServedIsKvCacheFromItsDescriptorPlusHealthAndReflection) {
  const RpcMethodSet served = RpcMethodSet::Served();
  const google::protobuf::ServiceDescriptor* kv =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(kKv);
  ASSERT_NE(kv, nullptr);
  ASSERT_GE(kv->method_count(), 10);
  for (int i = 0; i < kv->method_count(); ++i) {
    EXPECT_TRUE(served.Contains(kKv, kv->method(i)->name())) << kv->method(i)->name();
  }
  EXPECT_TRUE(served.Contains("grpc.health.v1.Health", "Check"));
  EXPECT_TRUE(served.Contains("grpc.health.v1.Health", "Watch"));
  EXPECT_TRUE(served.Contains("grpc.reflection.v1alpha.ServerReflection", "ServerReflectionInfo"));
  EXPECT_EQ(served.List().size(), static_cast<size_t>(kv->method_count()) + 3);
  EXPECT_FALSE(served.Contains(kKv, "NoSuchMethod"));
  EXPECT_FALSE(served.Contains("grpc.health.v1.Health", "Append"));
  EXPECT_FALSE(served.Contains("", ""));
}

TEST(ServerMetrics, RendersBuildInfoDrainingAndIpcRegions) {
  auto m = NewMetrics();
  ASSERT_NE(m, nullptr);
  std::string text = m->Render();
  EXPECT_THAT(text, HasSubstr(absl::StrCat("# TYPE mlakv_build_info gauge\nmlakv_build_info{allocator=\"", MallocLibrary(),
                                           "\",version=\"1.2.3\"} 1\n")));
  EXPECT_THAT(text, HasSubstr("# TYPE mlakv_draining gauge\nmlakv_draining 0\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE mlakv_ipc_regions gauge\nmlakv_ipc_regions 0\n"));
  EXPECT_EQ(Value(text, "mlakv_transport_busy_seconds_total"), 0);  // no source yet
  m->SetDraining(true);
  m->SetIpcRegionSource([] { return int64_t{3}; });
  m->SetTransportSource([] { return SerialExecutor::Load{.busy_seconds = 1.25, .pending = 2}; });
  text = m->Render();
  EXPECT_EQ(Value(text, "mlakv_draining"), 1);
  EXPECT_EQ(Value(text, "mlakv_ipc_regions"), 3);
  EXPECT_EQ(Value(text, "mlakv_transport_busy_seconds_total"), 1.25);
  EXPECT_EQ(Value(text, "mlakv_transport_tasks"), 2);
  EXPECT_THAT(text, HasSubstr("# TYPE mlakv_transport_busy_seconds_total counter\n"));
}

TEST(ServerMetrics, RendersTheKvEventsBufferFromItsSource) {
  auto m = NewMetrics();
  ASSERT_NE(m, nullptr);
  std::string text = m->Render();
  EXPECT_THAT(text, HasSubstr("# TYPE mlakv_kv_events_kept_bytes gauge\nmlakv_kv_events_kept_bytes 0\n"));
  EventLog log({.replay_capacity = 4, .replay_bytes = 1 << 20});
  for (int i = 0; i < 6; ++i) log.Record(KvEvent{.kind = KvEvent::Kind::kStored, .pages = {1, 2, 3}});
  m->SetEventsSource([&log] { return ScrapeTimeCollector::EventsLoad{.log = log.stats(), .watchers = 2}; });
  text = m->Render();
  EXPECT_EQ(Value(text, "mlakv_kv_events_recorded_total"), 6);
  EXPECT_EQ(Value(text, "mlakv_kv_events_kept"), 4) << "the ring's count bound";
  EXPECT_EQ(Value(text, "mlakv_kv_events_kept_bytes"), static_cast<double>(log.stats().kept_bytes));
  EXPECT_GT(Value(text, "mlakv_kv_events_kept_bytes"), 4 * sizeof(KvEvent));
  EXPECT_EQ(Value(text, "mlakv_kv_events_watchers"), 2);
  EXPECT_THAT(text, HasSubstr("# TYPE mlakv_kv_events_recorded_total counter\n"));
  EXPECT_THAT(text, Not(HasSubstr("mlakv_kv_events_zmq"))) << "no publisher, no ZeroMQ families";
  m->SetEventsSource([&log] {
    return ScrapeTimeCollector::EventsLoad{
        .log = log.stats(),
        .zmq = EventPublisherStats{
            .batches = 7, .replays_done = 3, .replays_abandoned = 2, .replays_dropped = 1, .replays_active = 4}};
  });
  text = m->Render();
  EXPECT_EQ(Value(text, "mlakv_kv_events_zmq_batches_total"), 7);
  EXPECT_EQ(Value(text, "mlakv_kv_events_zmq_replays_total", {{"result", "done"}}), 3);
  EXPECT_EQ(Value(text, "mlakv_kv_events_zmq_replays_total", {{"result", "abandoned"}}), 2);
  EXPECT_EQ(Value(text, "mlakv_kv_events_zmq_replays_total", {{"result", "dropped"}}), 1);
  EXPECT_EQ(Value(text, "mlakv_kv_events_zmq_replays"), 4);
  EXPECT_THAT(text, HasSubstr("# TYPE mlakv_kv_events_zmq_replays_total counter\n"));
  m->SetEventsSource(nullptr);  // before the log goes
}

TEST(ServerMetrics, ServedMethodsKeepTheirLabels) {
  auto m = NewMetrics();
  ASSERT_NE(m, nullptr);
  m->RpcStarted(kKv, "ListPools");
  EXPECT_EQ(Value(m->Render(), "mlakv_rpcs_in_flight", {{"service", kKv}, {"method", "ListPools"}}), 1);
  m->RpcFinished(kKv, "ListPools", grpc::StatusCode::OK, 0.001);
  m->RpcStarted(kKv, "GetSequence");
  m->RpcFinished(kKv, "GetSequence", grpc::StatusCode::NOT_FOUND, 0.002);
  m->RpcStarted("grpc.health.v1.Health", "Check");
  m->RpcFinished("grpc.health.v1.Health", "Check", grpc::StatusCode::OK, 0.0001);
  const std::string text = m->Render();
  EXPECT_EQ(Value(text, "mlakv_rpcs_total", {{"service", kKv}, {"method", "ListPools"}, {"code", "OK"}}), 1);
  EXPECT_EQ(Value(text, "mlakv_rpcs_in_flight", {{"service", kKv}, {"method", "ListPools"}}), 0);
  EXPECT_EQ(Value(text, "mlakv_rpcs_total", {{"service", kKv}, {"method", "GetSequence"}, {"code", "NOT_FOUND"}}), 1);
  EXPECT_EQ(Value(text, "mlakv_rpc_errors_total", {{"service", kKv}, {"method", "GetSequence"}, {"code", "NOT_FOUND"}}),
            1);
  EXPECT_EQ(Value(text, "mlakv_rpc_errors_total", {{"service", kKv}, {"method", "ListPools"}, {"code", "OK"}}), 0);
  EXPECT_EQ(Value(text, "mlakv_rpcs_total", {{"service", "grpc.health.v1.Health"}, {"method", "Check"}, {"code", "OK"}}),
            1);
  EXPECT_EQ(Value(text, "mlakv_rpc_latency_seconds_count", {{"service", kKv}, {"method", "GetSequence"}}), 1);
  EXPECT_EQ(Value(text, "mlakv_rpc_latency_seconds_sum", {{"service", kKv}, {"method", "GetSequence"}}), 0.002);
}

TEST(ServerMetrics, MethodsOutsideTheServedSetCountAsUnknown) {
  auto m = NewMetrics();
  ASSERT_NE(m, nullptr);
  const std::vector<std::pair<std::string, std::string>> calls = {
      {kKv, "NoSuchMethod"},                 // known service, unknown method
      {"evil.Service", "Append"},            // unknown service, a KvCache method's name
      {"grpc.health.v1.Health", "Append"},   // a method of another served service
      {"unknown", "x\"}\nmlakv_forged 1"},   // quotes and newlines
      {"", ""},
  };
  for (const auto& [service, method] : calls) {
    m->RpcStarted(service, method);
    m->RpcFinished(service, method, grpc::StatusCode::UNIMPLEMENTED, 0.0001);
  }
  const std::string text = m->Render();
  EXPECT_EQ(LabelValues(text, "service"), (std::set<std::string>{"unknown"}));
  EXPECT_EQ(LabelValues(text, "method"), (std::set<std::string>{"unknown"}));
  EXPECT_EQ(Value(text, "mlakv_rpcs_total", {{"service", "unknown"}, {"method", "unknown"}, {"code", "UNIMPLEMENTED"}}),
            5);
  EXPECT_EQ(Value(text, "mlakv_rpcs_in_flight", {{"service", "unknown"}, {"method", "unknown"}}), 0);
  EXPECT_THAT(text, Not(HasSubstr("forged")));
}

// The buckets are the ones the hand-written registry had: 100 us .. 30 s.
TEST(ServerMetrics, LatencyHistogramsKeepTheirBuckets) {
  auto m = NewMetrics();
  ASSERT_NE(m, nullptr);
  m->RpcStarted(kKv, "Append");
  m->RpcFinished(kKv, "Append", grpc::StatusCode::OK, 0.003);
  m->AppendFinished("Append", "", true, 1, 1152, 0.003);
  m->KernelRan("default", "cpu", 0.003);
  const std::string text = m->Render();
  const std::vector<std::string> expected = {"0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005",
                                             "0.01",   "0.025",   "0.05",   "0.1",   "0.25",   "0.5",
                                             "1",      "2.5",     "5",      "10",    "30",     "+Inf"};
  for (const char* family :
       {"mlakv_rpc_latency_seconds", "mlakv_append_latency_seconds", "mlakv_kernel_latency_seconds"}) {
    std::vector<std::string> le;
    std::vector<double> counts;
    for (const Sample& s : Parse(text)) {
      if (s.name == std::string(family) + "_bucket") {
        le.push_back(s.labels.at("le"));
        counts.push_back(s.value);
      }
    }
    EXPECT_EQ(le, expected) << family;
    ASSERT_EQ(counts.size(), expected.size()) << family;
    // 0.003 s: above 0.0025, at or below 0.005 (cumulative).
    EXPECT_EQ(counts[4], 0) << family;
    EXPECT_EQ(counts[5], 1) << family;
    EXPECT_EQ(counts.back(), 1) << family;
  }
  EXPECT_THAT(text, HasSubstr("# TYPE mlakv_rpc_latency_seconds histogram\n"));
}

TEST(ServerMetrics, AppendPoolLabelIsAConfiguredPoolOrUnknown) {
  auto m = NewMetrics();
  ASSERT_NE(m, nullptr);
  m->SetPools({"default", "big"});
  m->AppendFinished("Append", "big", true, 10, 100, 0.01);
  m->AppendFinished("Append", "", true, 20, 200, 0.01);  // empty: the default pool
  m->AppendFinished("Append", "no-such-pool", true, 30, 300, 0.01);
  m->AppendFinished("AppendBatch", "another\none", true, 40, 400, 0.01);
  m->AppendFinished("Append", "big", false, 99, 999, 0.01);  // failed: latency only
  const std::string text = m->Render();
  EXPECT_EQ(Value(text, "mlakv_appended_rows_total", {{"pool", "big"}, {"method", "Append"}}), 10);
  EXPECT_EQ(Value(text, "mlakv_appended_bytes_total", {{"pool", "big"}, {"method", "Append"}}), 100);
  EXPECT_EQ(Value(text, "mlakv_appended_rows_total", {{"pool", "default"}, {"method", "Append"}}), 20);
  EXPECT_EQ(Value(text, "mlakv_appended_rows_total", {{"pool", "unknown"}, {"method", "Append"}}), 30);
  EXPECT_EQ(Value(text, "mlakv_appended_bytes_total", {{"pool", "unknown"}, {"method", "Append"}}), 300);
  EXPECT_EQ(Value(text, "mlakv_appended_rows_total", {{"pool", "unknown"}, {"method", "AppendBatch"}}), 40);
  EXPECT_EQ(Value(text, "mlakv_append_latency_seconds_count", {{"method", "Append"}}), 4);
  EXPECT_EQ(LabelValues(text, "pool"), (std::set<std::string>{"big", "default", "unknown"}));
}

TEST(ServerMetrics, BeforeSetPoolsEveryPoolIsUnknown) {
  auto m = NewMetrics();
  ASSERT_NE(m, nullptr);
  m->AppendFinished("Append", "default", true, 1, 1, 0.01);
  EXPECT_EQ(Value(m->Render(), "mlakv_appended_rows_total", {{"pool", "unknown"}, {"method", "Append"}}), 1);
}

TEST(ServerMetrics, AppendMethodLabelIsBoundedToo) {
  auto m = NewMetrics();
  ASSERT_NE(m, nullptr);
  m->SetPools({"default"});
  m->AppendFinished("Bogus", "", true, 1, 1, 0.01);
  const std::string text = m->Render();
  EXPECT_EQ(Value(text, "mlakv_appended_rows_total", {{"pool", "default"}, {"method", "unknown"}}), 1);
  EXPECT_EQ(Value(text, "mlakv_append_latency_seconds_count", {{"method", "unknown"}}), 1);
}

TEST(ServerMetrics, PoolGaugesAreReadAtScrapeTime) {
  auto m = NewMetrics();
  ASSERT_NE(m, nullptr);
  std::atomic<uint64_t> used{3};
  m->SetPoolSource([&used] {
    const uint64_t u = used.load();
    PoolSnapshot p;
    p.name = "default";
    p.device = Device::Cpu();
    p.pages_total = 10;
    p.pages_used = static_cast<int32_t>(u);
    p.pages_free = static_cast<int32_t>(10 - u);
    p.sequences = 2;
    p.cache_bytes = 4096;
    p.pages_shared = 4;
    p.leases = 5;
    p.sequences_retained = 1;
    p.pages_indexed = 6;
    p.counters.evictions = 11;
    p.counters.leases_expired = 12;
    p.counters.prefix_hit_pages = 13;
    p.counters.pages_copied = 14;
    p.worker = {.busy_seconds = 2.5, .pending = 3};
    return std::vector<PoolSnapshot>{p};
  });
  const std::map<std::string, std::string> pd = {{"pool", "default"}, {"device", "cpu"}};
  std::string text = m->Render();
  EXPECT_EQ(Value(text, "mlakv_pool_pages_capacity", pd), 10);
  EXPECT_EQ(Value(text, "mlakv_pool_pages_used", pd), 3);
  EXPECT_EQ(Value(text, "mlakv_pool_pages_free", pd), 7);
  EXPECT_EQ(Value(text, "mlakv_pool_sequences", {{"pool", "default"}}), 2);
  EXPECT_EQ(Value(text, "mlakv_pool_cache_bytes", pd), 4096);
  const std::map<std::string, std::string> pool = {{"pool", "default"}};
  EXPECT_EQ(Value(text, "mlakv_pool_pages_shared", pool), 4);
  EXPECT_EQ(Value(text, "mlakv_pool_leases", pool), 5);
  EXPECT_EQ(Value(text, "mlakv_pool_sequences_retained", pool), 1);
  EXPECT_EQ(Value(text, "mlakv_pool_pages_indexed", pool), 6);
  EXPECT_EQ(Value(text, "mlakv_evictions_total", pool), 11);
  EXPECT_EQ(Value(text, "mlakv_leases_expired_total", pool), 12);
  EXPECT_EQ(Value(text, "mlakv_prefix_hit_pages_total", pool), 13);
  EXPECT_EQ(Value(text, "mlakv_pages_copied_total", pool), 14);
  EXPECT_EQ(Value(text, "mlakv_pool_worker_busy_seconds_total", pool), 2.5);
  EXPECT_EQ(Value(text, "mlakv_pool_worker_tasks", pool), 3);
  EXPECT_THAT(text, HasSubstr("# TYPE mlakv_pool_worker_busy_seconds_total counter\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE mlakv_pool_worker_tasks gauge\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE mlakv_evictions_total counter\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE mlakv_pool_leases gauge\n"));
  used = 9;
  text = m->Render();
  EXPECT_EQ(Value(text, "mlakv_pool_pages_used", pd), 9);
  EXPECT_EQ(Value(text, "mlakv_pool_pages_free", pd), 1);
  m->SetPoolSource(nullptr);  // after it returns, no scrape calls the old source
  text = m->Render();
  EXPECT_THAT(text, HasSubstr("# TYPE mlakv_pool_pages_used gauge\n"));
  EXPECT_THAT(text, Not(HasSubstr("mlakv_pool_pages_used{")));
}

TEST(ServerMetrics, KernelAndAuthCounters) {
  auto m = NewMetrics();
  ASSERT_NE(m, nullptr);
  m->KernelRan("default", "cuda:0", 0.5);
  m->KernelRan("default", "cuda:0", 0.25);
  m->AuthFailed("missing");
  m->AuthFailed("invalid");
  m->AuthFailed("invalid");
  const std::string text = m->Render();
  EXPECT_EQ(Value(text, "mlakv_kernel_calls_total", {{"pool", "default"}, {"device", "cuda:0"}}), 2);
  EXPECT_EQ(Value(text, "mlakv_kernel_seconds_total", {{"pool", "default"}, {"device", "cuda:0"}}), 0.75);
  EXPECT_EQ(Value(text, "mlakv_kernel_latency_seconds_count", {{"pool", "default"}, {"device", "cuda:0"}}), 2);
  EXPECT_EQ(Value(text, "mlakv_auth_failures_total", {{"reason", "missing"}}), 1);
  EXPECT_EQ(Value(text, "mlakv_auth_failures_total", {{"reason", "invalid"}}), 2);
}

TEST(ServerMetrics, ConcurrentUpdatesAreAllCounted) {
  auto m = NewMetrics();
  ASSERT_NE(m, nullptr);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&m, t] {
      for (int i = 0; i < 5000; ++i) {
        const std::string method = t % 2 ? "ListPools" : "GetPool";
        m->RpcStarted(kKv, method);
        m->RpcFinished(kKv, method, grpc::StatusCode::OK, 0.001);
        if (i % 1000 == 0) m->Render();
      }
    });
  }
  for (auto& t : threads) t.join();
  const std::string text = m->Render();
  EXPECT_EQ(Value(text, "mlakv_rpcs_total", {{"service", kKv}, {"method", "ListPools"}, {"code", "OK"}}), 10000);
  EXPECT_EQ(Value(text, "mlakv_rpcs_total", {{"service", kKv}, {"method", "GetPool"}, {"code", "OK"}}), 10000);
  EXPECT_EQ(Value(text, "mlakv_rpc_latency_seconds_count", {{"service", kKv}, {"method", "GetPool"}}), 10000);
  EXPECT_EQ(Value(text, "mlakv_rpcs_in_flight", {{"service", kKv}, {"method", "GetPool"}}), 0);
}

// ---- through a real server: KvCacheServer with the interceptor and on_append ----

class MetricsOnServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::err);  // 200 refused appends would each log a warning
    metrics_ = NewMetrics();
    ASSERT_NE(metrics_, nullptr);
    v1::ServerConfig config;
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
        R"pb(pools { name: "default" num_layers: 2 page_size: 16 num_pages: 64 }
             pools { name: "second" num_layers: 2 page_size: 16 num_pages: 64 })pb",
        &config));
    KvCacheServer::Options options;
    options.config = config;
    options.default_device = "cpu";
    options.metrics = metrics_.get();
    absl::StatusOr<std::unique_ptr<KvCacheServer>> server = KvCacheServer::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = server_->InProcessChannel();
  }

  // A unary call with an empty request message, through the generic stub.
  grpc::Status GenericUnary(const std::string& path) {
    grpc::GenericStub stub(channel_);
    grpc::CompletionQueue cq;
    grpc::ClientContext ctx;
    grpc::Slice empty("");
    grpc::ByteBuffer request(&empty, 1), response;
    grpc::Status status;
    auto call = stub.PrepareUnaryCall(&ctx, path, request, &cq);
    call->StartCall();
    call->Finish(&response, &status, this);
    void* tag;
    bool ok;
    EXPECT_TRUE(cq.Next(&tag, &ok));
    return status;
  }

  std::unique_ptr<ServerMetrics> metrics_;  // outlives the server
  std::unique_ptr<KvCacheServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

// 20,000 calls with random method names (which once made /metrics 80 MB):
// every one is counted, under service="unknown", method="unknown", and the
// scrape stays small with every method label from the served set.
TEST_F(MetricsOnServerTest, RandomMethodNamesLeaveMetricsSmall) {
  constexpr int kCalls = 20000;
  constexpr int kWindow = 256;
  const size_t before = metrics_->Render().size();
  grpc::GenericStub stub(channel_);
  grpc::CompletionQueue cq;
  std::mt19937 gen(1234);
  const std::string alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.";
  auto random_name = [&](int len) {
    std::string s;
    for (int i = 0; i < len; ++i) s += alphabet[gen() % alphabet.size()];
    return s;
  };
  struct Call {
    grpc::ClientContext ctx;
    grpc::ByteBuffer response;
    grpc::Status status;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> rpc;
  };
  grpc::Slice empty("");
  const grpc::ByteBuffer request(&empty, 1);
  int started = 0;
  auto start = [&] {
    std::string path;
    switch (started % 3) {  // unknown services, and unknown methods of served services
      case 0: path = "/" + random_name(12) + ".Svc/" + random_name(20); break;
      case 1: path = std::string("/") + kKv + "/" + random_name(24); break;
      default: path = "/grpc.health.v1.Health/" + random_name(16); break;
    }
    auto* c = new Call;
    c->rpc = stub.PrepareUnaryCall(&c->ctx, path, request, &cq);
    c->rpc->StartCall();
    c->rpc->Finish(&c->response, &c->status, c);
    ++started;
  };
  for (int i = 0; i < kWindow; ++i) start();
  std::map<grpc::StatusCode, int> codes;
  for (int done = 0; done < kCalls; ++done) {
    void* tag;
    bool ok;
    ASSERT_TRUE(cq.Next(&tag, &ok));
    auto* c = static_cast<Call*>(tag);
    ++codes[c->status.error_code()];
    delete c;
    if (started < kCalls) start();
  }
  EXPECT_EQ(codes[grpc::StatusCode::UNIMPLEMENTED], kCalls);

  const std::string text = metrics_->Render();
  EXPECT_LT(text.size(), 200u * 1024) << "metrics grew with the method names clients sent";
  EXPECT_LT(text.size() - before, 8u * 1024) << "from " << before << " to " << text.size() << " bytes";
  EXPECT_EQ(Value(text, "mlakv_rpcs_total", {{"service", "unknown"}, {"method", "unknown"}, {"code", "UNIMPLEMENTED"}}),
            kCalls);
  EXPECT_EQ(Value(text, "mlakv_rpcs_in_flight", {{"service", "unknown"}, {"method", "unknown"}}), 0);
  const RpcMethodSet served = RpcMethodSet::Served();
  for (const Sample& s : Parse(text)) {
    if (!s.labels.contains("method") || !s.labels.contains("service")) continue;
    const std::string& service = s.labels.at("service");
    const std::string& method = s.labels.at("method");
    EXPECT_TRUE((service == "unknown" && method == "unknown") || served.Contains(service, method))
        << s.name << " service=" << service << " method=" << method;
  }
  for (const std::string& method : LabelValues(text, "method")) {
    EXPECT_TRUE(method == "unknown" || served.Contains(kKv, method) || served.Contains("grpc.health.v1.Health", method))
        << method;
  }
}

// The names RpcMethodSet lists for health and reflection are the ones the
// server's calls carry: real calls of each keep their labels.
TEST_F(MetricsOnServerTest, ServedMethodsThroughTheInterceptorKeepTheirLabels) {
  EXPECT_TRUE(GenericUnary("/mlakv.v1.KvCache/ListPools").ok());
  EXPECT_TRUE(GenericUnary("/grpc.health.v1.Health/Check").ok());
  {
    // Reflection: one list_services request (field 7, empty string) on its
    // bidirectional stream.
    grpc::GenericStub stub(channel_);
    grpc::CompletionQueue cq;
    grpc::ClientContext ctx;
    void* tag;
    bool ok;
    auto call = stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
    call->StartCall(reinterpret_cast<void*>(1));
    ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
    grpc::Slice list_services(std::string("\x3a\x00", 2));
    grpc::ByteBuffer request(&list_services, 1), response;
    call->Write(request, reinterpret_cast<void*>(2));
    ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
    call->Read(&response, reinterpret_cast<void*>(3));
    ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(response.Dump(&slices).ok());
    std::string body;
    for (const grpc::Slice& s : slices) body.append(reinterpret_cast<const char*>(s.begin()), s.size());
    EXPECT_THAT(body, HasSubstr(kKv));
    call->WritesDone(reinterpret_cast<void*>(4));
    ASSERT_TRUE(cq.Next(&tag, &ok));
    grpc::Status status;
    call->Finish(&status, reinterpret_cast<void*>(5));
    ASSERT_TRUE(cq.Next(&tag, &ok));
    EXPECT_TRUE(status.ok()) << status.error_message();
  }
  const std::string text = metrics_->Render();
  EXPECT_EQ(Value(text, "mlakv_rpcs_total", {{"service", kKv}, {"method", "ListPools"}, {"code", "OK"}}), 1);
  EXPECT_EQ(Value(text, "mlakv_rpcs_total", {{"service", "grpc.health.v1.Health"}, {"method", "Check"}, {"code", "OK"}}),
            1);
  EXPECT_EQ(Value(text, "mlakv_rpcs_total",
                  {{"service", "grpc.reflection.v1alpha.ServerReflection"},
                   {"method", "ServerReflectionInfo"},
                   {"code", "OK"}}),
            1);
  EXPECT_EQ(Value(text, "mlakv_rpcs_total", {{"service", "unknown"}, {"method", "unknown"}, {"code", "OK"}}), 0);
}

// Appends naming pools that do not exist are refused and add no pool label;
// appends to the configured pools count under their names (KvCacheServer
// hands its pools to SetPools).
TEST_F(MetricsOnServerTest, AppendsNamingUnknownPoolsAddNoPoolLabel) {
  auto stub = v1::KvCache::NewStub(channel_);
  const testing::Rows rows = testing::RandomRows(4, 7);
  auto append = [&](const std::string& pool, const std::string& sequence) {
    v1::AppendRequest m = testing::AppendMessage(sequence, 0, rows, 0, rows.n, {0}, 1.0f, 1.0f);
    m.set_pool(pool);
    grpc::ClientContext ctx;
    v1::AppendResponse resp;
    auto writer = stub->Append(&ctx, &resp);
    writer->Write(m);
    writer->WritesDone();
    return writer->Finish();
  };
  std::mt19937 gen(99);
  for (int i = 0; i < 200; ++i) {
    const std::string pool = "pool-" + std::to_string(gen());
    grpc::Status s = append(pool, "seq-" + std::to_string(i));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << pool << ": " << s.error_message();
  }
  ASSERT_TRUE(append("second", "in-second").ok());
  ASSERT_TRUE(append("", "in-default").ok());
  const std::string text = metrics_->Render();
  EXPECT_EQ(Value(text, "mlakv_appended_rows_total", {{"pool", "second"}, {"method", "Append"}}), 4);
  EXPECT_EQ(Value(text, "mlakv_appended_rows_total", {{"pool", "default"}, {"method", "Append"}}), 4);
  EXPECT_EQ(Value(text, "mlakv_appended_bytes_total", {{"pool", "second"}, {"method", "Append"}}), 4 * 576 * 2);
  EXPECT_EQ(Value(text, "mlakv_append_latency_seconds_count", {{"method", "Append"}}), 202);
  EXPECT_EQ(Value(text, "mlakv_rpcs_total", {{"service", kKv}, {"method", "Append"}, {"code", "NOT_FOUND"}}), 200);
  for (const std::string& pool : LabelValues(text, "pool")) {
    EXPECT_TRUE(pool == "default" || pool == "second") << pool;
  }
  EXPECT_THAT(text, Not(HasSubstr("pool-")));
}

}  // namespace
}  // namespace mlakv::server
