// cache_management_bench: what cache management costs (docs/performance.md
// "Cache management").
//
//   cache_management_bench [--device cpu] [--chain_pages 2048] [--match_samples 2000]
//                          [--churn_seconds 60] [--churn_rows 64]
//
// 1. MatchPrefix of a --chain_pages chain (page size 64: 128k tokens at
//    2048): a sequence of that many pages is appended (one layer) with one
//    32-byte block hash per page, then the whole chain is matched
//    --match_samples times. Server time = Pool::MatchPrefix alone (the pool
//    lock and the index walk); end to end = the MatchPrefix RPC over the
//    in-process channel (parsing 2048 hashes included), against the same-run
//    reference of a GetPool RPC (the smallest call that takes the pool lock).
//    Also a miss at the first hash (the shortest walk).
// 2. Eviction churn: a pool of 1 layer, page size 16, 1024 pages with
//    eviction lru, kept full for --churn_seconds by new sequences of
//    --churn_rows rows each (one Append stream of one message, as a prefill
//    worker sends it): evictions/s, appends/s, and the append latency
//    percentiles; against the same-run reference of the same appends into a
//    pool without eviction whose client frees its oldest sequence before
//    each append (what a client has to do without eviction).
// In-process KvCacheServer (no sockets), so the figures are the server's and
// gRPC's own; medians and percentiles of many samples.
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <cstring>
#include <thread>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "bench/bench_stats.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"
#include "server/rpc/kv_cache_server.h"
#include "spdlog/sinks/null_sink.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, device, "cpu", "pool device (cpu or cuda:N)");
ABSL_FLAG(int, chain_pages, 2048, "pages of the chain MatchPrefix walks");
ABSL_FLAG(int, match_samples, 2000, "MatchPrefix calls per variant");
ABSL_FLAG(int, churn_seconds, 60, "seconds of eviction churn per variant");
ABSL_FLAG(int, churn_rows, 64, "rows per churn append");

namespace mlakv {
namespace {

using bench::Clock;
using bench::Micros;
using bench::Summarize;
using bench::Summary;

[[noreturn]] void Die(const std::string& what) { bench::Die("cache_management_bench", what); }

void Print(const char* what, const Summary& s) {
  std::printf("  %-44s n=%-6zu p50 %9.2f us  p90 %9.2f  p99 %9.2f  max %9.2f\n", what, s.n, s.p50, s.p90, s.p99,
              s.max);
}

std::string Hash(int page) {
  std::string h(32, '\0');
  std::mt19937_64 gen(page * 7919 + 1);
  for (size_t i = 0; i < h.size(); i += 8) {
    const uint64_t v = gen();
    std::memcpy(&h[i], &v, 8);
  }
  return h;
}

// n bf16 rows of a small finite value (the content does not matter here).
v1::AppendRequest Message(const std::string& pool, const std::string& seq, uint32_t start, uint32_t n) {
  v1::AppendRequest m;
  m.set_pool(pool);
  m.set_sequence(seq);
  m.set_start(start);
  m.set_row_count(n);
  m.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  m.set_view(v1::SEQUENCE_VIEW_BASIC);
  v1::LayerRows* lr = m.add_layers();
  lr->set_layer(0);
  lr->set_ckv(std::string(size_t{n} * 1024, '\x3c'));
  lr->set_kpe(std::string(size_t{n} * 128, '\x3c'));
  return m;
}

grpc::Status AppendOne(v1::KvCache::Stub& stub, const v1::AppendRequest& m) {
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  auto w = stub.Append(&ctx, &resp);
  w->Write(m);
  w->WritesDone();
  return w->Finish();
}

void MatchPrefixPhase(server::KvCacheServer& srv, v1::KvCache::Stub& stub) {
  const int pages = absl::GetFlag(FLAGS_chain_pages), samples = absl::GetFlag(FLAGS_match_samples);
  std::vector<std::string> chain;
  for (int p = 0; p < pages; ++p) chain.push_back(Hash(p));
  // The sequence, 64 pages (4096 rows) per message, hashes in the first.
  constexpr uint32_t kRowsPerMessage = 4096;
  std::vector<v1::AppendRequest> messages;
  for (uint32_t start = 0; start < static_cast<uint32_t>(pages) * 64; start += kRowsPerMessage) {
    messages.push_back(Message(start == 0 ? "chain" : "", start == 0 ? "prompt" : "", start, kRowsPerMessage));
    if (start != 0) messages.back().clear_view();
  }
  for (const std::string& h : chain) messages.front().add_block_hashes(h);
  {
    grpc::ClientContext ctx;
    v1::AppendResponse resp;
    auto w = stub.Append(&ctx, &resp);
    for (const auto& m : messages) w->Write(m);
    w->WritesDone();
    if (grpc::Status s = w->Finish(); !s.ok()) Die("chain append: " + s.error_message());
  }
  server::Pool& pool = *srv.pools()[0];
  if (pool.Snapshot().pages_indexed != static_cast<uint32_t>(pages)) Die("the chain is not indexed");
  std::vector<double> direct, direct_miss, rpc, reference;
  v1::MatchPrefixRequest req;
  req.set_pool("chain");
  for (const std::string& h : chain) req.add_block_hashes(h);
  const std::vector<std::string> miss = {Hash(-1)};
  for (int i = 0; i < samples; ++i) {
    auto t0 = Clock::now();
    absl::StatusOr<server::PrefixMatch> m = pool.MatchPrefix(chain);
    auto t1 = Clock::now();
    if (!m.ok() || m->matched_pages != static_cast<uint32_t>(pages)) Die("direct match");
    direct.push_back(Micros(t1 - t0));
    t0 = Clock::now();
    (void)pool.MatchPrefix(miss);
    direct_miss.push_back(Micros(Clock::now() - t0));
    {
      grpc::ClientContext ctx;
      v1::MatchPrefixResponse resp;
      t0 = Clock::now();
      grpc::Status s = stub.MatchPrefix(&ctx, req, &resp);
      rpc.push_back(Micros(Clock::now() - t0));
      if (!s.ok() || resp.matched_pages() != static_cast<uint32_t>(pages)) Die("rpc match: " + s.error_message());
    }
    {
      grpc::ClientContext ctx;
      v1::GetPoolRequest g;
      g.set_pool("chain");
      v1::Pool resp;
      t0 = Clock::now();
      (void)stub.GetPool(&ctx, g, &resp);
      reference.push_back(Micros(Clock::now() - t0));
    }
  }
  std::printf("MatchPrefix of a %d-page chain (page size 64, %d tokens), %d samples each:\n", pages, pages * 64,
              samples);
  Print("Pool::MatchPrefix, full chain (server time)", Summarize(direct));
  Print("Pool::MatchPrefix, miss at the first hash", Summarize(direct_miss));
  Print("MatchPrefix RPC, full chain (in-process)", Summarize(rpc));
  Print("reference: GetPool RPC (in-process)", Summarize(reference));
}

struct ChurnResult {
  Summary latency;
  double appends_per_s = 0, evictions_per_s = 0;
};

ChurnResult Churn(server::KvCacheServer& srv, v1::KvCache::Stub& stub, const std::string& pool_name,
                  bool free_oldest) {
  const int seconds = absl::GetFlag(FLAGS_churn_seconds);
  const uint32_t rows = static_cast<uint32_t>(absl::GetFlag(FLAGS_churn_rows));
  server::Pool* pool = nullptr;
  for (const auto& p : srv.pools()) {
    if (p->name() == pool_name) pool = p.get();
  }
  v1::AppendRequest m = Message(pool_name, "", 0, rows);
  std::deque<std::string> live;
  std::vector<double> latency;
  const uint64_t evictions_before = pool->Snapshot().counters.evictions;
  const auto start = Clock::now();
  const auto end = start + std::chrono::seconds(seconds);
  int64_t n = 0;
  while (Clock::now() < end) {
    const std::string id = absl::StrCat("c", n++);
    m.set_sequence(id);
    auto t0 = Clock::now();
    if (free_oldest && pool->Snapshot().pages_free < static_cast<int32_t>((rows + 15) / 16)) {
      grpc::ClientContext ctx;
      v1::FreeSequenceRequest f;
      f.set_pool(pool_name);
      f.set_sequence(live.front());
      v1::FreeSequenceResponse resp;
      if (grpc::Status s = stub.FreeSequence(&ctx, f, &resp); !s.ok()) Die("free: " + s.error_message());
      live.pop_front();
    }
    if (grpc::Status s = AppendOne(stub, m); !s.ok()) Die("churn append: " + s.error_message());
    latency.push_back(Micros(Clock::now() - t0));
    live.push_back(id);
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  ChurnResult r;
  r.latency = Summarize(latency);
  r.appends_per_s = static_cast<double>(latency.size()) / elapsed;
  r.evictions_per_s = static_cast<double>(pool->Snapshot().counters.evictions - evictions_before) / elapsed;
  if (absl::Status inv = pool->CheckInvariants(); !inv.ok()) Die(std::string(inv.message()));
  return r;
}

int Main() {
  auto logger = std::make_shared<spdlog::logger>("bench", std::make_shared<spdlog::sinks::null_sink_mt>());
  spdlog::set_default_logger(logger);
  const std::string device = absl::GetFlag(FLAGS_device);
  const int pages = absl::GetFlag(FLAGS_chain_pages);
  server::KvCacheServer::Options options;
  options.default_device = device;
  auto add = [&](const std::string& name, uint32_t page_size, uint32_t num_pages, bool lru) {
    v1::PoolConfig* p = options.config.add_pools();
    p->set_name(name);
    p->set_num_layers(1);
    p->set_page_size(page_size);
    p->set_num_pages(num_pages);
    p->mutable_all_layers()->set_ckv_scale(1.0f);
    p->mutable_all_layers()->set_kpe_scale(1.0f);
    if (lru) p->mutable_eviction()->set_policy("lru");
  };
  add("chain", 64, static_cast<uint32_t>(pages), false);
  add("churn", 16, 1024, true);
  add("freeing", 16, 1024, false);
  absl::StatusOr<std::unique_ptr<server::KvCacheServer>> created = server::KvCacheServer::Create(options);
  if (!created.ok()) Die(std::string(created.status().message()));
  auto channel = (*created)->InProcessChannel();
  auto stub = v1::KvCache::NewStub(channel);
  std::printf("cache_management_bench: device %s, %u cores\n", device.c_str(), std::thread::hardware_concurrency());
  MatchPrefixPhase(**created, *stub);
  std::printf("Eviction churn: 1 layer, page size 16, 1024 pages, new sequences of %d rows, %d s per variant:\n",
              absl::GetFlag(FLAGS_churn_rows), absl::GetFlag(FLAGS_churn_seconds));
  const ChurnResult lru = Churn(**created, *stub, "churn", false);
  const ChurnResult manual = Churn(**created, *stub, "freeing", true);
  Print("append, pool kept full by lru eviction", lru.latency);
  std::printf("  %-44s %.0f appends/s, %.0f evictions/s\n", "", lru.appends_per_s, lru.evictions_per_s);
  Print("reference: client frees its oldest, then appends", manual.latency);
  std::printf("  %-44s %.0f appends/s\n", "", manual.appends_per_s);
  return 0;
}

}  // namespace
}  // namespace mlakv

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return mlakv::Main();
}
