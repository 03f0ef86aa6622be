// ingest_floor_bench: how far mlakv's bytes ingest (one Append stream of one
// message at a time) is from what gRPC itself moves on this host, measured in
// one process run (docs/performance.md "Bytes ingest: the floor and the copies
// of a message").
//
//   ingest_floor_bench [--rows 3584] [--samples 200] [--rounds 5] [--device cpu|cuda:0]
//
// Every variant sends the same Append messages (one layer of --rows bf16 rows,
// 3584 rows = 3.94 MiB: `mlakv bench`'s message) over loopback TCP, one call
// in flight, on a connection of its own:
//   typed -> sync   the generated stub (rows copied into the message, then
//                   serialized) into a minimal sync server that parses each
//                   message (the rows copied out into strings) and answers
//   typed -> raw    the same client into a minimal callback server that takes
//                   each message as a ByteBuffer and drops it: gRPC's
//                   transport with no parse on the server
//   mlakv client -> raw   KvCacheClient::Append into that raw server: what the
//                   client's own serialization costs over the transport (the
//                   rows copied once; "by reference": AppendRows::rows_owner
//                   set, the rows not copied at all)
//   mlakv           KvCacheClient::Append (both ways) into a KvCacheServer
//                   with one pool on --device (the whole service: parse,
//                   staging, kernel, commit)
// The variants take turns in --rounds rounds of --samples calls. Printed per
// variant: p50 / p90 / p99 of a call, the rows' GB/s at the p50, and each
// p50 over the typed -> raw floor.
#include <grpcpp/grpcpp.h>
#include <malloc.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_stats.h"
#include "client/kv_cache_client.h"
#include "client/load_generator.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"
#include "server/rpc/kv_cache_server.h"
#include "spdlog/sinks/null_sink.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(int, rows, 3584, "rows per message (one layer, bf16)");
ABSL_FLAG(int, samples, 200, "calls per variant per round");
ABSL_FLAG(int, rounds, 5, "rounds (the variants take turns)");
ABSL_FLAG(std::string, device, "cpu", "the mlakv variant's pool device: cpu, cuda:N");

namespace mlakv {
namespace {

using bench::Clock;
using bench::Micros;
using bench::Summarize;
using bench::Summary;

[[noreturn]] void Die(const std::string& what) { bench::Die("ingest_floor_bench", what); }

constexpr size_t kRowBytes = (512 + 64) * 2;

// Parses every message (protobuf copies the rows out of the transport's
// buffers) and answers an empty response.
class SyncParsingAppend final : public v1::KvCache::Service {
 public:
  grpc::Status Append(grpc::ServerContext*, grpc::ServerReader<v1::AppendRequest>* reader,
                      v1::AppendResponse*) override {
    v1::AppendRequest message;
    uint64_t bytes = 0;
    while (reader->Read(&message)) {
      for (const v1::LayerRows& l : message.layers()) bytes += l.ckv().size() + l.kpe().size();
    }
    return bytes > 0 ? grpc::Status::OK : grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no rows");
  }
};

// Takes each message as gRPC delivers it (a ByteBuffer of the transport's
// slices) and drops it.
class Dropper final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  explicit Dropper(grpc::ByteBuffer* response) : response_(response) { StartRead(&message_); }
  void OnReadDone(bool ok) override {
    if (ok) {
      bytes_ += message_.Length();
      message_.Clear();
      StartRead(&message_);
      return;
    }
    v1::AppendResponse r;
    bool own = false;
    (void)grpc::SerializationTraits<v1::AppendResponse>::Serialize(r, response_, &own);
    Finish(bytes_ > 0 ? grpc::Status::OK : grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no rows"));
  }
  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer* response_;
  grpc::ByteBuffer message_;
  uint64_t bytes_ = 0;
};

// The raw Append on a service of its own (the generated callback service's
// other methods stay unimplemented).
class RawAppendService final : public v1::KvCache::WithRawCallbackMethod_Append<v1::KvCache::Service> {
 public:
  grpc::ServerReadReactor<grpc::ByteBuffer>* Append(grpc::CallbackServerContext*,
                                                    grpc::ByteBuffer* response) override {
    return new Dropper(response);
  }
};

std::unique_ptr<grpc::Server> StartMinimal(grpc::Service* service, int* port) {
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  b.SetMaxReceiveMessageSize(-1);
  b.RegisterService(service);
  std::unique_ptr<grpc::Server> s = b.BuildAndStart();
  if (s == nullptr || *port == 0) Die("minimal server did not start");
  return s;
}

std::shared_ptr<grpc::Channel> Channel(int port) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
  args.SetMaxSendMessageSize(-1);
  return grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), args);
}

std::unique_ptr<KvCacheClient> Client(int port) {
  KvCacheClient::Options o;
  o.target = "127.0.0.1:" + std::to_string(port);
  o.timeout = absl::Seconds(10);
  absl::StatusOr<std::unique_ptr<KvCacheClient>> c = KvCacheClient::Create(o);
  if (!c.ok()) Die(std::string(c.status().message()));
  return std::move(*c);
}

int Main() {
  auto logger = std::make_shared<spdlog::logger>("bench", std::make_shared<spdlog::sinks::null_sink_mt>());
  spdlog::set_default_logger(logger);
  // As mlakv-server and the CLI do: 4 MB buffers from the heap, not fresh mmaps.
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  const int rows = absl::GetFlag(FLAGS_rows), samples = absl::GetFlag(FLAGS_samples);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  if (rows < 1) Die("--rows must be >= 1");

  SyncParsingAppend sync_service;
  RawAppendService raw_service;
  int sync_port = 0, raw_port = 0;
  std::unique_ptr<grpc::Server> sync_server = StartMinimal(&sync_service, &sync_port);
  std::unique_ptr<grpc::Server> raw_server = StartMinimal(&raw_service, &raw_port);

  server::KvCacheServer::Options options;
  options.listen = "127.0.0.1:0";
  options.default_device = absl::GetFlag(FLAGS_device);
  v1::PoolConfig* pool = options.config.add_pools();
  pool->set_name("default");
  pool->set_num_layers(1);
  pool->set_page_size(64);
  pool->set_num_pages(static_cast<uint32_t>((rows + 63) / 64 * 4 + 8));
  absl::StatusOr<std::unique_ptr<server::KvCacheServer>> mlakv = server::KvCacheServer::Create(options);
  if (!mlakv.ok()) Die(std::string(mlakv.status().message()));

  auto owned = std::make_shared<const std::pair<std::string, std::string>>(
      RandomRowBytes(size_t(rows) * 512, v1::ROW_DTYPE_BFLOAT16, 1),
      RandomRowBytes(size_t(rows) * 64, v1::ROW_DTYPE_BFLOAT16, 2));
  const std::string& ckv = owned->first;
  const std::string& kpe = owned->second;
  AppendRows append;
  append.sequence = "ingest";
  append.rows = static_cast<uint32_t>(rows);
  append.dtype = v1::ROW_DTYPE_BFLOAT16;
  append.layers.push_back({.layer = 0, .ckv = ckv, .kpe = kpe, .ckv_scale = 8.0f / (6 * 448), .kpe_scale = 8.0f / 448});
  AppendRows by_reference = append;  // the rows sent by reference (AppendRows::rows_owner)
  by_reference.rows_owner = owned;

  // The generated stub, the message built the plain way.
  auto typed_call = [&](v1::KvCache::Stub& stub) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::AppendResponse response;
    auto writer = stub.Append(&ctx, &response);
    v1::AppendRequest m;
    m.set_sequence(append.sequence);
    m.set_row_count(append.rows);
    m.set_dtype(append.dtype);
    v1::LayerRows* l = m.add_layers();
    l->set_ckv(ckv);
    l->set_kpe(kpe);
    l->set_ckv_scale(*append.layers[0].ckv_scale);
    l->set_kpe_scale(*append.layers[0].kpe_scale);
    writer->Write(m, grpc::WriteOptions().set_last_message());
    const grpc::Status s = writer->Finish();
    if (!s.ok()) Die("typed Append failed: " + s.error_message());
  };
  auto sync_stub = v1::KvCache::NewStub(Channel(sync_port));
  auto raw_stub = v1::KvCache::NewStub(Channel(raw_port));
  std::unique_ptr<KvCacheClient> raw_client = Client(raw_port);
  std::unique_ptr<KvCacheClient> mlakv_client = Client((*mlakv)->bound_port());
  uint32_t position = 0;
  const uint32_t capacity = pool->num_pages() * 64 / 2;

  struct Variant {
    const char* name;
    std::function<void()> call;
    std::function<void()> untimed;
    std::vector<double> us;
  };
  std::vector<Variant> variants = {
      {"typed client -> minimal sync server", [&] { typed_call(*sync_stub); }, nullptr, {}},
      {"typed client -> minimal raw server", [&] { typed_call(*raw_stub); }, nullptr, {}},
      {"mlakv client -> minimal raw server",
       [&] {
         absl::StatusOr<v1::AppendResponse> r = raw_client->Append(append);
         if (!r.ok()) Die("client Append failed: " + std::string(r.status().message()));
       },
       nullptr,
       {}},
      {"mlakv client, by reference -> raw", [&] {
         absl::StatusOr<v1::AppendResponse> r = raw_client->Append(by_reference);
         if (!r.ok()) Die("client Append failed: " + std::string(r.status().message()));
       },
       nullptr,
       {}},
  };
  // mlakv appends at the end of one sequence, freed (untimed) when the pool fills.
  auto free_when_full = [&] {
    if (position + append.rows <= capacity) return;
    if (!mlakv_client->Free("", append.sequence).ok()) Die("free failed");
    position = 0;
  };
  for (AppendRows* a : {&append, &by_reference}) {
    variants.push_back({a == &append ? "mlakv client -> mlakv-server" : "mlakv client, by reference -> mlakv-server",
                        [&, a] {
                          a->start = position;
                          absl::StatusOr<v1::AppendResponse> r = mlakv_client->Append(*a);
                          if (!r.ok()) Die("mlakv Append failed: " + std::string(r.status().message()));
                          position += a->rows;
                        },
                        free_when_full,
                        {}});
  }
  for (Variant& v : variants) {
    for (int i = 0; i < 20; ++i) {  // connect and warm up
      if (v.untimed) v.untimed();
      v.call();
    }
  }
  for (int round = 0; round < rounds; ++round) {
    for (Variant& v : variants) {
      for (int i = 0; i < samples; ++i) {
        if (v.untimed) v.untimed();
        const auto t0 = Clock::now();
        v.call();
        v.us.push_back(Micros(Clock::now() - t0));
      }
    }
  }
  const double bytes = double(rows) * kRowBytes;
  std::printf("ingest_floor_bench: %d x %d Append calls of one %d-row message (%.2f MiB) per variant, loopback TCP, "
              "%u cores, mlakv on %s\n",
              rounds, samples, rows, bytes / (1 << 20), std::thread::hardware_concurrency(),
              options.default_device.c_str());
  const double floor = Summarize(variants[1].us).p50;  // typed -> raw
  for (const Variant& v : variants) {
    const Summary s = Summarize(v.us);
    std::printf("  %-44s p50 %8.1f us  p90 %8.1f  p99 %8.1f   %.2f GB/s at p50   p50 / raw floor %.2fx\n", v.name,
                s.p50, s.p90, s.p99, bytes / s.p50 / 1e3, s.p50 / floor);
  }
  (*mlakv)->Shutdown(absl::Seconds(1));
  sync_server->Shutdown();
  raw_server->Shutdown();
  return 0;
}

}  // namespace
}  // namespace mlakv

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return mlakv::Main();
}
