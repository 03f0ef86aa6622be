// rpc_floor_bench: how far mlakv's unary calls are from gRPC's own floor on
// this host, measured in one process run (docs/performance.md "The RPC floor").
//
//   rpc_floor_bench [--samples 5000] [--rounds 5] [--alone sync|callback|async]
//                   [--external NAME=HOST:PORT,...] [--in_turn_only] [--rpc_threads N]
//                   [--quiet_ms 1,10,100 [--quiet_calls 30]]
//   rpc_floor_bench --serve sync --port P
//
// Four servers on loopback TCP (127.0.0.1, a port each), one client channel
// (one connection) each, all in this process:
//   sync      a minimal server, grpc.health.v1.Health/Check -> SERVING, sync API
//   callback  the same Check with the callback API
//   mlakv     a KvCacheServer as mlakv-server builds it (cpu pool, the metrics
//             interceptor on): its Health/Check and its GetPool
//   bare      the same without the metrics interceptor: GetPool
//   and a minimal sync and a minimal callback server whose GetPool does
//   mlakv's work (a 61-layer pool's snapshot and response) and nothing else
// Calls are unary with a deadline, made one at a time; the variants take turns
// in --rounds rounds of --samples calls so that the machine's drift hits all
// alike. Before any of that, the minimal sync server is timed alone in the
// process, then beside an idle callback server: a callback service starts
// gRPC's nexting threads, which take over polling the process's sockets
// (docs/performance.md "The callback API's threads"). Printed: p50 / p90 / p99
// per variant and the ratio of each p50 to the sync floor's beside the other
// servers and alone. First of all, each of a minimal sync server, a minimal
// completion-queue server and mlakv-server is timed alone in the process, in
// turn (TimeEachAloneInTurn): the comparison the RPC aim is stated in, since
// mlakv-server serves every method on its own completion queue.
// --alone sync|callback|async times one minimal server of that API with
// nothing else in the process. --external NAME=ADDR,... adds servers running
// in processes of their own (mlakv-server builds, and `rpc_floor_bench
// --serve sync --port P`: the minimal sync server in its own process) to the
// rounds in turn; --in_turn_only stops after those rounds. --quiet_ms then
// times every variant's call after each quiet spell given (the client
// sleeping, every server idle): what a layer-wise save's commit meets.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_stats.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"
#include "server/core/pool.h"
#include "server/observability/server_metrics.h"
#include "server/rpc/proto_convert.h"
#include "server/rpc/kv_cache_server.h"
#include "spdlog/sinks/null_sink.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(int, samples, 5000, "calls per variant per round");
ABSL_FLAG(int, rounds, 5, "rounds (the variants take turns)");
ABSL_FLAG(std::string, alone, "",
          "\"sync\", \"callback\" or \"async\": time only that minimal Health/Check server, alone in this process, "
          "and exit");
ABSL_FLAG(std::vector<std::string>, external, {},
          "NAME=HOST:PORT,...: mlakv-servers running in processes of their own, timed (Health/Check and GetPool) in "
          "turn with the servers of this process");
ABSL_FLAG(std::string, serve, "",
          "\"sync\": serve a minimal sync Health/Check + GetPool's work server on 127.0.0.1:--port until killed "
          "(a floor in a process of its own, for --external)");
ABSL_FLAG(int, port, 0, "--serve: the port");
ABSL_FLAG(bool, in_turn_only, false, "time the servers alone in turn, then stop (skip the mixed rounds)");
ABSL_FLAG(int, rpc_threads, 0, "mlakv-server's completion-queue threads (0: its default, KvCacheServer::Options)");
ABSL_FLAG(int, async_threads, 2, "--alone async: threads polling the completion queues");
ABSL_FLAG(std::vector<std::string>, quiet_ms, {},
          "after the rounds, also time each variant's call after each of these quiet spells (ms of the client "
          "sleeping, every server idle), the variants in turn call by call");
ABSL_FLAG(int, quiet_calls, 30, "--quiet_ms: calls per variant per quiet spell");
ABSL_FLAG(int, async_queues, 0,
          "--alone async: completion queues the threads share out (0: one queue per thread; 1: every thread on one "
          "queue)");

namespace mlakv {
namespace {

using bench::Clock;
using bench::Micros;
using bench::Summarize;
using bench::Summary;
using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

[[noreturn]] void Die(const std::string& what) { bench::Die("rpc_floor_bench", what); }

class SyncHealth final : public Health::Service {
 public:
  grpc::Status Check(grpc::ServerContext*, const HealthCheckRequest*, HealthCheckResponse* resp) override {
    resp->set_status(HealthCheckResponse::SERVING);
    return grpc::Status::OK;
  }
};

class CallbackHealth final : public Health::CallbackService {
 public:
  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx, const HealthCheckRequest*,
                                  HealthCheckResponse* resp) override {
    resp->set_status(HealthCheckResponse::SERVING);
    grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
    r->Finish(grpc::Status::OK);
    return r;
  }
};

// GetPool alone, on each API: the same work as mlakv's (a snapshot of a
// 61-layer pool and its response) without the rest of the server, so the API's
// share and the work's share of mlakv's GetPool show apart.
class SyncGetPool final : public v1::KvCache::Service {
 public:
  explicit SyncGetPool(server::Pool* pool) : pool_(pool) {}
  grpc::Status GetPool(grpc::ServerContext*, const v1::GetPoolRequest*, v1::Pool* resp) override {
    server::ToProto(pool_->Snapshot(), resp);
    return grpc::Status::OK;
  }

 private:
  server::Pool* pool_;
};

class CallbackGetPool final : public v1::KvCache::CallbackService {
 public:
  explicit CallbackGetPool(server::Pool* pool) : pool_(pool) {}
  grpc::ServerUnaryReactor* GetPool(grpc::CallbackServerContext* ctx, const v1::GetPoolRequest*,
                                    v1::Pool* resp) override {
    server::ToProto(pool_->Snapshot(), resp);
    grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
    r->Finish(grpc::Status::OK);
    return r;
  }

 private:
  server::Pool* pool_;
};

std::unique_ptr<grpc::Server> StartMinimal(grpc::Service* service, int* port) {
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  b.RegisterService(service);
  std::unique_ptr<grpc::Server> s = b.BuildAndStart();
  if (s == nullptr || *port == 0) Die("minimal server did not start");
  return s;
}

std::shared_ptr<grpc::Channel> Channel(int port) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
  return grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args);
}

template <typename Call>
double TimeOne(Call&& call) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  const auto t0 = Clock::now();
  const grpc::Status s = call(ctx);
  const double us = Micros(Clock::now() - t0);
  if (!s.ok()) Die("call failed: " + s.error_message());
  return us;
}

// `calls` Health/Checks to the server on `port` over a channel of their own,
// after 200 to connect and warm up.
std::vector<double> TimeChecks(int port, int calls) {
  auto stub = Health::NewStub(Channel(port));
  auto check = [&](grpc::ClientContext& c) {
    HealthCheckResponse r;
    return stub->Check(&c, HealthCheckRequest(), &r);
  };
  for (int i = 0; i < 200; ++i) TimeOne(check);
  std::vector<double> us;
  us.reserve(calls);
  for (int i = 0; i < calls; ++i) us.push_back(TimeOne(check));
  return us;
}

// The same Check on the completion-queue API: --async_threads threads over
// --async_queues queues (thread t on queue t % queues), answering each call
// on the thread that took it from its queue.
class AsyncHealth {
 public:
  AsyncHealth(int threads, int queues) : threads_(threads), queues_(queues <= 0 ? threads : queues) {}
  ~AsyncHealth() { Stop(); }

  std::unique_ptr<grpc::Server> Start(int* port) {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:" + std::to_string(*port), grpc::InsecureServerCredentials(), port);
    b.RegisterService(&service_);
    for (int i = 0; i < queues_; ++i) cqs_.push_back(b.AddCompletionQueue());
    std::unique_ptr<grpc::Server> s = b.BuildAndStart();
    if (s == nullptr || *port == 0) Die("minimal async server did not start");
    for (int t = 0; t < threads_; ++t) {
      grpc::ServerCompletionQueue* q = cqs_[t % queues_].get();
      if (t < queues_) Expect(q);  // one call expected per queue
      workers_.emplace_back([this, q] { Serve(q); });
    }
    return s;
  }
  // After the server's Shutdown.
  void Stop() {
    for (auto& cq : cqs_) cq->Shutdown();
    for (std::thread& t : workers_) t.join();
    workers_.clear();
    cqs_.clear();
  }

 private:
  struct Call {
    grpc::ServerContext ctx;
    HealthCheckRequest request;
    HealthCheckResponse response;
    grpc::ServerAsyncResponseWriter<HealthCheckResponse> writer{&ctx};
    bool answered = false;
  };
  void Expect(grpc::ServerCompletionQueue* cq) {
    Call* call = new Call;
    service_.RequestCheck(&call->ctx, &call->request, &call->writer, cq, cq, call);
  }
  void Serve(grpc::ServerCompletionQueue* cq) {
    void* tag = nullptr;
    bool ok = false;
    while (cq->Next(&tag, &ok)) {
      Call* call = static_cast<Call*>(tag);
      if (!ok || call->answered) {  // answered, or no call came before the shutdown
        delete call;
        continue;
      }
      Expect(cq);  // the next call, before answering this one
      call->response.set_status(HealthCheckResponse::SERVING);
      call->answered = true;
      call->writer.Finish(call->response, grpc::Status::OK, call);
    }
  }

  const int threads_;
  const int queues_;
  Health::AsyncService service_;
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> cqs_;
  std::vector<std::thread> workers_;
};

// One minimal Health server of one API, nothing else in the process: gRPC's
// floor for that API without the other API's threads polling beside it.
int TimeAlone(grpc::Service* service, const char* name, int calls) {
  int port = 0;
  AsyncHealth async(absl::GetFlag(FLAGS_async_threads), absl::GetFlag(FLAGS_async_queues));
  std::unique_ptr<grpc::Server> server = service != nullptr ? StartMinimal(service, &port) : async.Start(&port);
  const Summary s = Summarize(TimeChecks(port, calls));
  std::printf("rpc_floor_bench --alone %s: %d calls, %u cores\n  %-44s p50 %7.1f us  p90 %7.1f  p99 %7.1f\n", name,
              calls, std::thread::hardware_concurrency(), "Health/Check, alone in the process", s.p50, s.p90, s.p99);
  server->Shutdown();
  async.Stop();
  return 0;
}

// Each server alone in the process, in turn: one is started, warmed up,
// timed for `samples` calls and shut down (its threads joined) before the
// next starts, `rounds` times over, before any callback service exists in the
// process (its nexting threads never stop once started). This is the
// comparison the aim is stated in (docs/performance.md "The RPC floor"):
// mlakv-server on its completion queue against a minimal synchronous server
// with no other server's threads polling beside either. mlakv-server's rows
// there include an AppendBatch of one bf16 row of bytes to a sequence of its
// own (freed, untimed, after each call): the least an append can cost; and
// the same row as an Append stream of one message and its half-close.
void TimeEachAloneInTurn(server::Pool* bench_pool, const server::KvCacheServer::Options& mlakv_options, int samples,
                         int rounds) {
  struct Alone {
    const char* name;
    std::vector<double> us = {};
  };
  std::vector<Alone> rows = {{"minimal sync server, Health/Check"},
                             {"minimal sync server, GetPool's work"},
                             {"minimal async server (1 thread), Health/Check"},
                             {"mlakv-server, Health/Check"},
                             {"mlakv-server, GetPool"},
                             {"mlakv-server, AppendBatch of one row"},
                             {"mlakv-server, Append stream of one row"}};
  constexpr size_t kFirstExternal = 7, kRowsPerExternal = 4;
  // name=address of each --external server; its rows follow the others.
  std::vector<std::pair<std::string, std::string>> externals;
  std::vector<std::string> names;  // the rows' names live here (Alone keeps a pointer)
  for (const std::string& e : absl::GetFlag(FLAGS_external)) {
    const size_t eq = e.find('=');
    if (eq == std::string::npos) Die("--external takes NAME=HOST:PORT, got " + e);
    externals.emplace_back(e.substr(0, eq), e.substr(eq + 1));
  }
  names.reserve(kRowsPerExternal * externals.size());
  for (const auto& [name, address] : externals) {
    names.push_back(name + " (own process), Health/Check");
    names.push_back(name + " (own process), GetPool");
    names.push_back(name + " (own process), AppendBatch of one row");
    names.push_back(name + " (own process), Append stream of one row");
  }
  for (const std::string& n : names) rows.push_back({n.c_str()});
  auto time_calls = [&](auto&& call, std::vector<double>* out) {
    for (int i = 0; i < 200; ++i) TimeOne(call);  // connect and warm up
    for (int i = 0; i < samples; ++i) out->push_back(TimeOne(call));
  };
  auto check_on = [](Health::Stub* stub) {
    return [stub](grpc::ClientContext& c) {
      HealthCheckResponse r;
      return stub->Check(&c, HealthCheckRequest(), &r);
    };
  };
  auto get_pool_on = [](v1::KvCache::Stub* stub) {
    return [stub](grpc::ClientContext& c) {
      v1::Pool r;
      return stub->GetPool(&c, v1::GetPoolRequest(), &r);
    };
  };
  // One bf16 row of bytes into layer 0 of pool "default" (a sequence of its
  // own, freed untimed after each call): the least work an append can be,
  // against GetPool (issue 16's "one row within 1.3x of GetPool", here
  // without a GPU: the pool's quantizer on one row is ~1 us).
  v1::AppendBatchRequest one_row;
  one_row.set_pool("default");
  one_row.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  one_row.set_view(v1::SEQUENCE_VIEW_COMPACT);
  {
    v1::SequenceRows* seq = one_row.add_sequences();
    seq->set_sequence("rpc-floor-one-row");
    seq->set_row_count(1);
    v1::LayerRows* layer = seq->add_layers();
    layer->set_layer(0);
    layer->set_ckv(std::string(512 * 2, '\x3c'));
    layer->set_kpe(std::string(64 * 2, '\x3c'));
    layer->set_ckv_scale(0.02f);
    layer->set_kpe_scale(0.05f);
  }
  // The same row as an Append stream: one message, then the half-close,
  // whose commit is the stream's end (docs/server.md "Concurrency").
  v1::AppendRequest one_message;
  one_message.set_pool("default");
  one_message.set_sequence("rpc-floor-one-row");
  one_message.set_row_count(1);
  one_message.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  one_message.set_view(v1::SEQUENCE_VIEW_COMPACT);
  *one_message.add_layers() = one_row.sequences(0).layers(0);
  auto time_one_rows = [&](v1::KvCache::Stub* stub, std::vector<double>* out, std::vector<double>* stream_out) {
    const auto append = [&](grpc::ClientContext& c) {
      v1::AppendBatchResponse r;
      return stub->AppendBatch(&c, one_row, &r);
    };
    const auto append_stream = [&](grpc::ClientContext& c) {
      v1::AppendResponse r;
      std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> w = stub->Append(&c, &r);
      w->Write(one_message);
      w->WritesDone();
      return w->Finish();
    };
    const auto free_it = [&](grpc::ClientContext& c) {
      v1::FreeSequenceRequest req;
      req.set_pool("default");
      req.set_sequence("rpc-floor-one-row");
      v1::FreeSequenceResponse r;
      return stub->FreeSequence(&c, req, &r);
    };
    {  // a server that does not serve AppendBatch (rpc_floor_bench --serve) gets no row
      grpc::ClientContext probe;
      v1::AppendBatchResponse r;
      if (stub->AppendBatch(&probe, one_row, &r).error_code() == grpc::StatusCode::UNIMPLEMENTED) return;
      TimeOne(free_it);
    }
    for (int i = 0; i < 200; ++i) TimeOne(append), TimeOne(free_it), TimeOne(append_stream), TimeOne(free_it);
    for (int i = 0; i < samples; ++i) {
      out->push_back(TimeOne(append));
      TimeOne(free_it);
      stream_out->push_back(TimeOne(append_stream));
      TimeOne(free_it);
    }
  };
  int mlakv_threads = 0;
  for (int round = 0; round < rounds; ++round) {
    {
      SyncHealth service;
      int port = 0;
      std::unique_ptr<grpc::Server> s = StartMinimal(&service, &port);
      auto stub = Health::NewStub(Channel(port));
      time_calls(check_on(stub.get()), &rows[0].us);
      s->Shutdown();
    }
    {
      SyncGetPool service(bench_pool);
      int port = 0;
      std::unique_ptr<grpc::Server> s = StartMinimal(&service, &port);
      auto stub = v1::KvCache::NewStub(Channel(port));
      time_calls(get_pool_on(stub.get()), &rows[1].us);
      s->Shutdown();
    }
    {
      AsyncHealth async(1, 1);
      int port = 0;
      std::unique_ptr<grpc::Server> s = async.Start(&port);
      auto stub = Health::NewStub(Channel(port));
      time_calls(check_on(stub.get()), &rows[2].us);
      s->Shutdown();
      async.Stop();
    }
    {
      absl::StatusOr<std::unique_ptr<server::KvCacheServer>> mlakv = server::KvCacheServer::Create(mlakv_options);
      if (!mlakv.ok()) Die(std::string(mlakv.status().message()));
      mlakv_threads = (*mlakv)->rpc_threads();
      auto channel = Channel((*mlakv)->bound_port());
      auto health = Health::NewStub(channel);
      auto stub = v1::KvCache::NewStub(channel);
      time_calls(check_on(health.get()), &rows[3].us);
      time_calls(get_pool_on(stub.get()), &rows[4].us);
      time_one_rows(stub.get(), &rows[5].us, &rows[6].us);
      (*mlakv)->Shutdown(absl::Seconds(1));
    }
    for (size_t e = 0; e < externals.size(); ++e) {
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      auto channel = grpc::CreateCustomChannel(externals[e].second, grpc::InsecureChannelCredentials(), args);
      auto health = Health::NewStub(channel);
      auto stub = v1::KvCache::NewStub(channel);
      time_calls(check_on(health.get()), &rows[kFirstExternal + kRowsPerExternal * e].us);
      time_calls(get_pool_on(stub.get()), &rows[kFirstExternal + kRowsPerExternal * e + 1].us);
      time_one_rows(stub.get(), &rows[kFirstExternal + kRowsPerExternal * e + 2].us,
                    &rows[kFirstExternal + kRowsPerExternal * e + 3].us);
    }
  }
  const double floor = Summarize(rows[0].us).p50;
  std::printf("rpc_floor_bench: each server alone in the process, in turn (%d rounds x %d calls), %u cores, "
              "mlakv-server on %d completion-queue threads\n",
              rounds, samples, std::thread::hardware_concurrency(), mlakv_threads);
  for (const Alone& row : rows) {
    if (row.us.empty()) continue;  // not served there
    const Summary s = Summarize(row.us);
    std::printf("  %-52s p50 %7.1f us  p90 %7.1f  p99 %7.1f   p50 / sync floor %.2fx\n", row.name, s.p50, s.p90,
                s.p99, s.p50 / floor);
  }
}

// The pool every server of the bench answers GetPool from: 61 layers, 256
// pages of 64 (a 286-byte snapshot).
std::unique_ptr<server::Pool> BenchPool() {
  server::Pool::Options pool_options;
  pool_options.name = "default";
  pool_options.num_layers = 61;
  pool_options.page_size = 64;
  pool_options.num_pages = 256;
  absl::StatusOr<std::unique_ptr<server::Pool>> pool = server::Pool::Create(pool_options);
  if (!pool.ok()) Die(std::string(pool.status().message()));
  return *std::move(pool);
}

// --serve sync: a minimal synchronous server in a process of its own, the
// floor that an mlakv-server in its own process is compared with
// (--external). It answers Health/Check and GetPool (a 61-layer pool's snapshot, as
// SyncGetPool).
int Serve(const std::string& api, int port) {
  std::unique_ptr<server::Pool> pool = BenchPool();
  SyncHealth health;
  SyncGetPool get_pool(pool.get());
  std::unique_ptr<grpc::Server> s;
  int bound = 0;
  if (api == "sync") {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:" + std::to_string(port), grpc::InsecureServerCredentials(), &bound);
    b.RegisterService(&health);
    b.RegisterService(&get_pool);
    s = b.BuildAndStart();
  } else {
    Die("--serve takes \"sync\"");
  }
  if (s == nullptr || bound == 0) Die("--serve: cannot listen");
  std::printf("rpc_floor_bench --serve %s: listening on 127.0.0.1:%d\n", api.c_str(), bound);
  std::fflush(stdout);
  s->Wait();
  return 0;
}

int Main() {
  auto logger = std::make_shared<spdlog::logger>("bench", std::make_shared<spdlog::sinks::null_sink_mt>());
  spdlog::set_default_logger(logger);
  const int samples = absl::GetFlag(FLAGS_samples), rounds = absl::GetFlag(FLAGS_rounds);
  const std::string alone = absl::GetFlag(FLAGS_alone);
  if (alone == "sync") {
    SyncHealth service;
    return TimeAlone(&service, "sync", samples * rounds);
  }
  if (alone == "callback") {
    CallbackHealth service;
    return TimeAlone(&service, "callback", samples * rounds);
  }
  if (alone == "async") {
    const int threads = absl::GetFlag(FLAGS_async_threads), queues = absl::GetFlag(FLAGS_async_queues);
    const std::string name =
        absl::StrCat("async (", threads, " threads on ", queues <= 0 ? threads : queues, " queues)");
    return TimeAlone(nullptr, name.c_str(), samples * rounds);
  }
  if (!alone.empty()) Die("--alone takes \"sync\", \"callback\" or \"async\"");
  if (!absl::GetFlag(FLAGS_serve).empty()) return Serve(absl::GetFlag(FLAGS_serve), absl::GetFlag(FLAGS_port));

  std::unique_ptr<server::Pool> bench_pool = BenchPool();
  absl::StatusOr<std::unique_ptr<server::ServerMetrics>> metrics = server::ServerMetrics::Create("bench");
  if (!metrics.ok()) Die(std::string(metrics.status().message()));
  server::KvCacheServer::Options options;
  options.listen = "127.0.0.1:0";
  options.default_device = "cpu";
  options.metrics = metrics->get();
  options.rpc_threads = absl::GetFlag(FLAGS_rpc_threads);
  v1::PoolConfig* pool = options.config.add_pools();
  pool->set_name("default");
  pool->set_num_layers(61);
  pool->set_page_size(64);
  pool->set_num_pages(256);
  TimeEachAloneInTurn(bench_pool.get(), options, samples, rounds);
  if (absl::GetFlag(FLAGS_in_turn_only)) return 0;

  SyncHealth sync_service;
  CallbackHealth callback_service;
  int sync_port = 0, callback_port = 0;
  std::unique_ptr<grpc::Server> sync_server = StartMinimal(&sync_service, &sync_port);
  // The sync floor twice before anything else starts: alone in the process,
  // then beside an idle callback server. A callback service starts gRPC's
  // nexting threads, which poll the process's sockets too (one epoll set), so
  // a sync call's request can be read on one of them and handed over.
  const std::vector<double> alone_us = TimeChecks(sync_port, samples * rounds);
  std::unique_ptr<grpc::Server> callback_server = StartMinimal(&callback_service, &callback_port);
  const std::vector<double> beside_us = TimeChecks(sync_port, samples * rounds);

  SyncGetPool sync_get_pool(bench_pool.get());
  CallbackGetPool callback_get_pool(bench_pool.get());
  int sync_get_pool_port = 0, callback_get_pool_port = 0;
  std::unique_ptr<grpc::Server> sync_get_pool_server = StartMinimal(&sync_get_pool, &sync_get_pool_port);
  std::unique_ptr<grpc::Server> callback_get_pool_server = StartMinimal(&callback_get_pool, &callback_get_pool_port);

  absl::StatusOr<std::unique_ptr<server::KvCacheServer>> mlakv = server::KvCacheServer::Create(options);
  if (!mlakv.ok()) Die(std::string(mlakv.status().message()));
  // The same server without the metrics interceptor: what per-call metrics cost.
  options.metrics = nullptr;
  absl::StatusOr<std::unique_ptr<server::KvCacheServer>> bare = server::KvCacheServer::Create(options);
  if (!bare.ok()) Die(std::string(bare.status().message()));

  auto sync_stub = Health::NewStub(Channel(sync_port));
  auto callback_stub = Health::NewStub(Channel(callback_port));
  auto mlakv_channel = Channel((*mlakv)->bound_port());
  auto mlakv_health = Health::NewStub(mlakv_channel);
  auto mlakv_stub = v1::KvCache::NewStub(mlakv_channel);
  auto bare_stub = v1::KvCache::NewStub(Channel((*bare)->bound_port()));
  auto sync_get_pool_stub = v1::KvCache::NewStub(Channel(sync_get_pool_port));
  auto callback_get_pool_stub = v1::KvCache::NewStub(Channel(callback_get_pool_port));

  struct Variant {
    const char* name;
    std::function<grpc::Status(grpc::ClientContext&)> call;
    std::vector<double> us = {};
  };
  std::vector<Variant> variants = {
      {"minimal sync server, Health/Check",
       [&](grpc::ClientContext& c) {
         HealthCheckResponse r;
         return sync_stub->Check(&c, HealthCheckRequest(), &r);
       }},
      {"minimal callback server, Health/Check",
       [&](grpc::ClientContext& c) {
         HealthCheckResponse r;
         return callback_stub->Check(&c, HealthCheckRequest(), &r);
       }},
      {"minimal sync server, GetPool's work",
       [&](grpc::ClientContext& c) {
         v1::Pool r;
         return sync_get_pool_stub->GetPool(&c, v1::GetPoolRequest(), &r);
       }},
      {"minimal callback server, GetPool's work",
       [&](grpc::ClientContext& c) {
         v1::Pool r;
         return callback_get_pool_stub->GetPool(&c, v1::GetPoolRequest(), &r);
       }},
      {"mlakv-server, Health/Check",
       [&](grpc::ClientContext& c) {
         HealthCheckResponse r;
         return mlakv_health->Check(&c, HealthCheckRequest(), &r);
       }},
      {"mlakv-server, GetPool",
       [&](grpc::ClientContext& c) {
         v1::Pool r;
         return mlakv_stub->GetPool(&c, v1::GetPoolRequest(), &r);
       }},
      {"mlakv-server without metrics, GetPool",
       [&](grpc::ClientContext& c) {
         v1::Pool r;
         return bare_stub->GetPool(&c, v1::GetPoolRequest(), &r);
       }},
  };
  // GetPool's work in this process, step by step, without gRPC.
  {
    std::vector<double> snap, to_proto, serialize, parse;
    std::string bytes;
    for (int i = 0; i < 20000; ++i) {
      const auto t0 = Clock::now();
      server::PoolSnapshot ps = bench_pool->Snapshot();
      const auto t1 = Clock::now();
      v1::Pool out;
      server::ToProto(ps, &out);
      const auto t2 = Clock::now();
      out.SerializeToString(&bytes);
      const auto t3 = Clock::now();
      v1::Pool back;
      if (!back.ParseFromString(bytes)) Die("parse");
      const auto t4 = Clock::now();
      snap.push_back(Micros(t1 - t0));
      to_proto.push_back(Micros(t2 - t1));
      serialize.push_back(Micros(t3 - t2));
      parse.push_back(Micros(t4 - t3));
    }
    std::printf("GetPool's work without gRPC (p50 of 20000, %zu-byte response): snapshot %.2f us, to proto %.2f us, "
                "serialize %.2f us, parse %.2f us\n",
                bytes.size(), Summarize(snap).p50, Summarize(to_proto).p50, Summarize(serialize).p50,
                Summarize(parse).p50);
  }
  for (Variant& v : variants) {
    for (int i = 0; i < 200; ++i) TimeOne(v.call);  // connect and warm up
  }
  for (int round = 0; round < rounds; ++round) {
    for (Variant& v : variants) {
      for (int i = 0; i < samples; ++i) v.us.push_back(TimeOne(v.call));
    }
  }
  std::printf("rpc_floor_bench: %d x %d unary calls per variant over loopback TCP, %u cores\n", rounds, samples,
              std::thread::hardware_concurrency());
  // Two floors: the minimal sync server's p50 in the variants' rounds (beside
  // every other server here, as before), and alone in the process.
  const double floor = Summarize(variants[0].us).p50;
  const double alone_floor = Summarize(alone_us).p50;
  auto print = [&](const char* name, const std::vector<double>& us) {
    const Summary s = Summarize(us);
    std::printf("  %-52s p50 %7.1f us  p90 %7.1f  p99 %7.1f   p50 / sync floor %.2fx, / alone %.2fx\n", name, s.p50,
                s.p90, s.p99, s.p50 / floor, s.p50 / alone_floor);
  };
  print("sync Health/Check, alone in the process", alone_us);
  print("sync Health/Check, beside an idle callback server", beside_us);
  for (const Variant& v : variants) print(v.name, v.us);
  // A call after a quiet spell: what the end of a layer-wise save meets
  // (its commit follows tens of ms of the forward pass; issue 18). Each
  // variant's call after the same sleep, in turn, so a host's drift and its
  // idle states hit all alike; against the minimal sync server's.
  for (const std::string& q : absl::GetFlag(FLAGS_quiet_ms)) {
    double quiet_ms = 0;
    if (!absl::SimpleAtod(q, &quiet_ms) || quiet_ms < 0) Die("--quiet_ms: not a number of ms: " + q);
    std::vector<std::vector<double>> after(variants.size());
    for (int i = 0; i < absl::GetFlag(FLAGS_quiet_calls); ++i) {
      for (size_t k = 0; k < variants.size(); ++k) {
        std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(quiet_ms));
        after[k].push_back(TimeOne(variants[k].call));
      }
    }
    const double quiet_floor = Summarize(after[0]).p50;
    std::printf("after %.1f ms of quiet (%d calls each, in turn):\n", quiet_ms, absl::GetFlag(FLAGS_quiet_calls));
    for (size_t k = 0; k < variants.size(); ++k) {
      const Summary s = Summarize(after[k]);
      std::printf("  %-52s p50 %7.1f us  p90 %7.1f   p50 / sync after the same quiet %.2fx\n", variants[k].name,
                  s.p50, s.p90, s.p50 / quiet_floor);
    }
  }
  (*mlakv)->Shutdown(absl::Seconds(1));
  (*bare)->Shutdown(absl::Seconds(1));
  sync_server->Shutdown();
  callback_server->Shutdown();
  sync_get_pool_server->Shutdown();
  callback_get_pool_server->Shutdown();
  return 0;
}

}  // namespace
}  // namespace mlakv

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return mlakv::Main();
}
