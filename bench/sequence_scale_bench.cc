// sequence_scale_bench: does a 1-row Append keep its latency with 1,000,000
// sequences in the pool, while GetPool and ListSequences are polled and the
// idle reaper frees sequences? (server/core/pool.h: no section under the pool's
// lock scans every sequence.)
//
//   sequence_scale_bench [--sequences 1000000] [--reference_sequences 1000]
//                        [--samples 4000] [--rounds 3] [--active 1000]
//
// Through the service rather than Pool directly: the promise is about the
// lock appends take, and what a client feels is the RPC; the in-process
// channel (no sockets) keeps every server-side step of an Append while
// leaving loopback TCP's noise out. The direct Pool calls at the end say how
// long each query itself holds the lock.
//
// One in-process KvCacheServer, cpu backend, two pools of 1 layer, page size
// 1: "ref" filled with --reference_sequences sequences, "big" with
// --sequences (AppendBatch calls of up to 10,000 new 1-row sequences). In
// each pool --active sequences, spread evenly over the id space, take the
// measured appends: one Append stream of one 1-row message at the sequence's
// end (expect_length, SEQUENCE_VIEW_BASIC, as the clients send them), timed
// from the call to its status. Phases, both pools, interleaved over --rounds
// so that the shared machine's drift hits both alike:
//   a   nothing else running
//   b0  one thread polling grpc.health.v1.Health/Check as fast as it can:
//       the same CPU and gRPC load as a poller but no pool lock (control)
//   b   one thread polling GetPool as fast as it can
//   c   one thread walking ListSequences (page_size 1000) over the whole
//       table, again and again
// then once, in "big":
//   d   the idle reaper freeing every inactive sequence meanwhile. That is
//       Pool::FreeIdle, the call the server's reaper thread makes, made on a
//       bench thread with the clock moved one TTL past the end of the fill:
//       the config's TTL is whole seconds and the fill's length is not known
//       in advance, so the server's own reaper cannot be made to start with
//       the phase. Its TTL (a day) never fires by itself.
//   d2  to see the reaper's lock holds themselves: the pool refilled with
//       --sequences other ids and reaped again, with no log lines and no
//       appends, while a probe takes the lock every 200 us (MeasureReaperHolds).
// The fill goes in a shuffled order, as in a server the use order (the
// reaper's) has nothing to do with the id order (the table's). The reaper
// logs one info line per sequence it frees; the bench's logger formats them
// into a null sink (the formatting is paid, nothing printed). Memory: RSS
// and the heap's bytes in use before and after each fill.
#include <grpcpp/grpcpp.h>
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/bench_stats.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"
#include "server/rpc/kv_cache_server.h"
#include "spdlog/sinks/null_sink.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(int64_t, sequences, 1000000, "sequences in the large pool");
ABSL_FLAG(int64_t, reference_sequences, 1000, "sequences in the reference pool");
ABSL_FLAG(int, samples, 4000, "appends timed per pool, phase and round");
ABSL_FLAG(int, rounds, 3, "rounds of phases a-c (interleaved between the pools)");
ABSL_FLAG(int, active, 1000, "sequences per pool that receive the timed appends");

namespace mlakv::bench {
namespace {

namespace v1 = ::mlakv::v1;
using server::KvCacheServer;
using server::Pool;

constexpr int kFillBatch = 10000;        // sequences per AppendBatch of the fill
constexpr uint32_t kListPageSize = 1000;  // ListSequences' largest page
constexpr uint32_t kIdleTtlSeconds = 86400;
constexpr int64_t kReapPhaseMaxSamples = 200000;
constexpr uint64_t kCacheBytesPerToken = 256 + 32 + 64;  // one layer's entry

[[noreturn]] void Die(const std::string& what) { bench::Die("sequence_scale_bench", what); }

void CheckOk(const grpc::Status& s, const char* what) {
  if (!s.ok()) Die(absl::StrFormat("%s failed: %d %s", what, static_cast<int>(s.error_code()), s.error_message()));
}

std::string SequenceId(int64_t i, const char* prefix = "seq") { return absl::StrFormat("%s-%08d", prefix, i); }

// One bf16 row (ckv 512 + kpe 64 elements) of varied finite values; every
// appended row is this one (the quantizer's cost does not depend on it).
struct Row {
  std::string ckv, kpe;
};

Row RandomRow() {
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  auto bf16 = [&](std::string& out, int n) {
    for (int i = 0; i < n; ++i) {
      const float f = normal(gen);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      const uint16_t h = static_cast<uint16_t>(u >> 16);
      out.append(reinterpret_cast<const char*>(&h), 2);
    }
  };
  Row r;
  bf16(r.ckv, 512);
  bf16(r.kpe, 64);
  return r;
}

// `sequences` plus `active` more for the refill (the active ones stay).
void AddPool(v1::ServerConfig& config, const std::string& name, int64_t sequences, int active,
             int64_t headroom_pages) {
  v1::PoolConfig* p = config.add_pools();
  p->set_name(name);
  p->set_device("cpu");
  p->set_num_layers(1);
  p->set_page_size(1);
  p->set_num_pages(static_cast<uint32_t>(sequences + headroom_pages));
  p->set_max_sequences(static_cast<uint32_t>(sequences + active + 16));
  p->set_sequence_idle_ttl_seconds(kIdleTtlSeconds);
  p->mutable_all_layers()->set_ckv_scale(1.0f);
  p->mutable_all_layers()->set_kpe_scale(1.0f);
}

// A pool under test and the sequences that take its timed appends.
struct Target {
  std::string pool;
  int64_t sequences = 0;
  std::vector<std::string> active;   // ids, spread evenly over the table
  std::vector<uint32_t> lengths;     // their current lengths
  size_t next = 0;                   // round robin over `active`
  v1::AppendRequest message;         // reused: ids and positions set per call
};

Target MakeTarget(const std::string& pool, int64_t sequences, int active, const Row& row) {
  Target t;
  t.pool = pool;
  t.sequences = sequences;
  const int64_t k = std::min<int64_t>(active, sequences);
  for (int64_t i = 0; i < k; ++i) {
    t.active.push_back(SequenceId(i * sequences / k));
    t.lengths.push_back(1);  // the fill wrote one row
  }
  v1::AppendRequest& m = t.message;
  m.set_pool(pool);
  m.set_row_count(1);
  m.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  m.set_view(v1::SEQUENCE_VIEW_BASIC);
  v1::LayerRows* lr = m.add_layers();
  lr->set_layer(0);
  lr->set_ckv(row.ckv);
  lr->set_kpe(row.kpe);
  return t;
}

// Creates sequences [0, n) of `pool` named `prefix`-i, one row each,
// kFillBatch per call, in a shuffled order: in a server the use order (the
// reaper's order) has nothing to do with the id order (the table's order),
// and in the table's memory neighbours by id are not neighbours in memory.
void Fill(v1::KvCache::Stub& stub, const std::string& pool, int64_t n, const Row& row, const char* prefix = "seq") {
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937_64(3));
  for (int64_t first = 0; first < n; first += kFillBatch) {
    v1::AppendBatchRequest req;
    req.set_pool(pool);
    req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
    req.set_view(v1::SEQUENCE_VIEW_BASIC);
    for (int64_t i = first; i < std::min(n, first + kFillBatch); ++i) {
      v1::SequenceRows* s = req.add_sequences();
      s->set_sequence(SequenceId(order[i], prefix));
      s->set_row_count(1);
      s->set_expect_length(0);
      v1::LayerRows* lr = s->add_layers();
      lr->set_layer(0);
      lr->set_ckv(row.ckv);
      lr->set_kpe(row.kpe);
    }
    grpc::ClientContext ctx;
    v1::AppendBatchResponse resp;
    CheckOk(stub.AppendBatch(&ctx, req, &resp), "fill AppendBatch");
  }
}

// One timed 1-row Append at the end of the next active sequence (us).
double AppendOnce(v1::KvCache::Stub& stub, Target& t) {
  const size_t i = t.next++ % t.active.size();
  t.message.set_sequence(t.active[i]);
  t.message.set_start(t.lengths[i]);
  t.message.set_expect_length(t.lengths[i]);
  const Clock::time_point t0 = Clock::now();
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> writer = stub.Append(&ctx, &resp);
  writer->Write(t.message);
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  const double us = Micros(Clock::now() - t0);
  CheckOk(status, "timed Append");
  ++t.lengths[i];
  return us;
}

// Runs `call` on its own thread, back to back, until Stop; records each
// call's latency.
class Poller {
 public:
  explicit Poller(std::function<void()> call)
      : started_(Clock::now()), thread_([this, call = std::move(call)] {
          while (!stop_.load(std::memory_order_relaxed)) {
            const Clock::time_point t0 = Clock::now();
            call();
            latencies_.push_back(Micros(Clock::now() - t0));
          }
        }) {}

  // Joins; returns the latencies (us) and sets the calls per second.
  std::vector<double> Stop(double* calls_per_second) {
    stop_ = true;
    thread_.join();
    *calls_per_second = static_cast<double>(latencies_.size()) / (Micros(Clock::now() - started_) * 1e-6);
    return std::move(latencies_);
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<double> latencies_;
  const Clock::time_point started_;
  std::thread thread_;  // last: starts once the rest exists
};

enum class Load { kNone, kHealth, kGetPool, kListSequences };
constexpr Load kLoads[] = {Load::kNone, Load::kHealth, Load::kGetPool, Load::kListSequences};

const char* LoadName(Load l) {
  switch (l) {
    case Load::kNone: return "a  alone";
    case Load::kHealth: return "b0 Health/Check poller (control)";
    case Load::kGetPool: return "b  GetPool poller";
    case Load::kListSequences: return "c  ListSequences walker";
  }
  return "?";
}

// The polling call of phase `load` against `pool` (null for phase a).
// ListSequences walks: each call continues from the previous page token and
// starts over at the end; `walks` counts completed walks.
std::function<void()> PollCall(Load load, v1::KvCache::Stub& stub, grpc::health::v1::Health::Stub& health,
                               const std::string& pool, std::shared_ptr<std::atomic<int>> walks) {
  switch (load) {
    case Load::kNone: return nullptr;
    case Load::kHealth:
      return [&health] {
        grpc::ClientContext ctx;
        grpc::health::v1::HealthCheckResponse resp;
        CheckOk(health.Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp), "Health/Check");
      };
    case Load::kGetPool:
      return [&stub, pool] {
        grpc::ClientContext ctx;
        v1::GetPoolRequest req;
        req.set_pool(pool);
        v1::Pool resp;
        CheckOk(stub.GetPool(&ctx, req, &resp), "GetPool");
      };
    case Load::kListSequences:
      return [&stub, pool, walks, token = std::string()]() mutable {
        grpc::ClientContext ctx;
        v1::ListSequencesRequest req;
        req.set_pool(pool);
        req.set_page_size(kListPageSize);
        req.set_page_token(token);
        v1::ListSequencesResponse resp;
        CheckOk(stub.ListSequences(&ctx, req, &resp), "ListSequences");
        token = resp.next_page_token();
        if (token.empty()) ++*walks;
      };
  }
  return nullptr;
}

// Samples of one (pool, phase) over all rounds, and the poller's calls.
struct PhaseResult {
  std::vector<double> appends;
  std::vector<double> round_p50;
  std::vector<double> polls;
  double polls_per_second = 0;  // summed over rounds, then averaged
  int walks = 0;
};

void RunPhase(v1::KvCache::Stub& stub, grpc::health::v1::Health::Stub& health, Target& t, Load load, int samples,
              PhaseResult& out) {
  auto walks = std::make_shared<std::atomic<int>>(0);
  std::function<void()> call = PollCall(load, stub, health, t.pool, walks);
  std::unique_ptr<Poller> poller = call ? std::make_unique<Poller>(call) : nullptr;
  if (poller) std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let the poller get going
  std::vector<double> round;
  for (int i = 0; i < samples; ++i) round.push_back(AppendOnce(stub, t));
  if (poller) {
    double rate = 0;
    std::vector<double> polls = poller->Stop(&rate);
    out.polls.insert(out.polls.end(), polls.begin(), polls.end());
    out.polls_per_second += rate;
  }
  out.walks += walks->load();
  out.round_p50.push_back(Median(round));
  out.appends.insert(out.appends.end(), round.begin(), round.end());
}

// Phase d: appends to `t` for as long as FreeIdle runs on `pool` with the
// clock at `reap_at`. Returns the append latencies; reports the reaper.
std::vector<double> RunReapPhase(v1::KvCache::Stub& stub, Target& t, Pool& pool, absl::Time reap_at, int* freed,
                                 double* reap_seconds) {
  std::atomic<bool> done{false};
  std::thread reaper([&] {
    const Clock::time_point t0 = Clock::now();
    *freed = pool.FreeIdle(reap_at);
    *reap_seconds = Micros(Clock::now() - t0) * 1e-6;
    done = true;
  });
  std::vector<double> appends;
  while (!done.load() && static_cast<int64_t>(appends.size()) < kReapPhaseMaxSamples) {
    appends.push_back(AppendOnce(stub, t));
  }
  reaper.join();
  return appends;
}

// The reaper's lock holds, seen from outside: FreeIdle on `pool` (clock at
// `reap_at`) with the log level at warn (no per-sequence line formatted),
// while one thread takes the pool's lock as a reader (Pool::Snapshot) every
// 200 us. A probe that arrives during a hold waits for the rest of it, so
// the probes' tail is the holds' length (longer if the reaper, re-locking at
// once, wins the lock again: absl::Mutex lets a running thread barge past a
// woken waiter). The probe sleeps between probes so that it does not take
// one of this machine's two cores from the reaper. Nothing else runs.
struct ReaperHolds {
  int freed = 0;
  double seconds = 0;
  std::vector<double> probe_us;
};

ReaperHolds MeasureReaperHolds(Pool& pool, absl::Time reap_at) {
  ReaperHolds out;
  std::atomic<bool> done{false};
  std::thread probe([&] {
    while (!done.load(std::memory_order_relaxed)) {
      const Clock::time_point t0 = Clock::now();
      server::PoolSnapshot s = pool.Snapshot();
      out.probe_us.push_back(Micros(Clock::now() - t0));
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  const spdlog::level::level_enum level = spdlog::default_logger()->level();
  spdlog::default_logger()->set_level(spdlog::level::warn);
  const Clock::time_point t0 = Clock::now();
  out.freed = pool.FreeIdle(reap_at);
  out.seconds = Micros(Clock::now() - t0) * 1e-6;
  spdlog::default_logger()->set_level(level);
  done = true;
  probe.join();
  return out;
}

void PrintReaperHolds(const ReaperHolds& h, int64_t refilled) {
  std::vector<double> v = h.probe_us;
  std::sort(v.begin(), v.end());
  const double batch_us = h.seconds * 1e6 / std::max(1.0, h.freed / 1024.0);
  auto count_over = [&](double us) { return v.end() - std::upper_bound(v.begin(), v.end(), us); };
  std::printf("reaper again, no log lines (refilled %lld; the active ones go too): freed %d in %.2f s, %.0f us per "
              "1024 sequences\nlock probe (Pool::Snapshot every 200 us): %zu probes, p50 %.1f us, p99 %.0f us, max %.0f us "
              "(%.1f batches); %ld waited > 100 us, %ld > 2 batches, %ld > 5 batches\n",
              static_cast<long long>(refilled), h.freed, h.seconds, batch_us, v.size(),
              v.empty() ? 0.0 : v[v.size() / 2], v.empty() ? 0.0 : v[std::min(v.size() - 1, v.size() * 99 / 100)],
              v.empty() ? 0.0 : v.back(),
              v.empty() ? 0.0 : v.back() / batch_us, static_cast<long>(count_over(100)),
              static_cast<long>(count_over(2 * batch_us)), static_cast<long>(count_over(5 * batch_us)));
}

void PrintAppendRow(const Target& t, const char* phase, const PhaseResult& r) {
  const Summary s = Summarize(r.appends);
  const Summary rounds = Summarize(r.round_p50);
  std::printf("| %s | %lld | %s | %zu | %.1f | %.1f | %.1f | %.0f | %.1f-%.1f |\n", t.pool.c_str(),
              static_cast<long long>(t.sequences), phase, s.n, s.p50, s.p90, s.p99, s.max, rounds.min, rounds.max);
}

void PrintPollRow(const Target& t, Load load, const PhaseResult& r, int rounds) {
  const Summary s = Summarize(r.polls);
  std::printf("| %s | %lld | %s | %zu | %.0f | %.1f | %.1f | %.1f | %.0f | %s |\n", t.pool.c_str(),
              static_cast<long long>(t.sequences), LoadName(load), s.n, r.polls_per_second / rounds, s.p50, s.p90,
              s.p99, s.max, load == Load::kListSequences ? absl::StrFormat("%d walks", r.walks).c_str() : "");
}

// Direct calls on the pool (no gRPC, nothing else running): about how long
// each query holds the pool's lock.
void PrintDirectCalls(const Target& t, Pool& pool) {
  std::vector<double> snapshot, listing;
  for (int i = 0; i < 2000; ++i) {
    const Clock::time_point t0 = Clock::now();
    server::PoolSnapshot s = pool.Snapshot();
    snapshot.push_back(Micros(Clock::now() - t0));
  }
  std::string token;
  for (int i = 0; i < 2000; ++i) {
    const Clock::time_point t0 = Clock::now();
    server::SequenceListing l = pool.ListSequences(kListPageSize, token);
    listing.push_back(Micros(Clock::now() - t0));
    token = l.next_page_token;
  }
  const Summary a = Summarize(snapshot), b = Summarize(listing);
  std::printf("| %s | %lld | Pool::Snapshot (GetPool) | %.2f | %.2f | %.1f |\n", t.pool.c_str(),
              static_cast<long long>(t.sequences), a.p50, a.p99, a.max);
  std::printf("| %s | %lld | Pool::ListSequences(1000) | %.1f | %.1f | %.1f |\n", t.pool.c_str(),
              static_cast<long long>(t.sequences), b.p50, b.p99, b.max);
}

void PrintMemory(const char* pool, int64_t n, const MemoryUse& before, const MemoryUse& after) {
  const double rss = static_cast<double>(after.rss_bytes) - static_cast<double>(before.rss_bytes);
  const double heap = static_cast<double>(after.heap_bytes) - static_cast<double>(before.heap_bytes);
  std::printf("| %s | %lld | %.1f MiB | %.0f B | %.0f B | %.0f B |\n", pool, static_cast<long long>(n),
              rss / (1 << 20), rss / n, (rss - static_cast<double>(kCacheBytesPerToken) * n) / n, heap / n);
}

int Main() {
  // As mlakv-server does (server/main.cc): large blocks stay in the heap.
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  auto logger = std::make_shared<spdlog::logger>("bench", std::make_shared<spdlog::sinks::null_sink_mt>());
  logger->set_level(spdlog::level::info);
  spdlog::set_default_logger(logger);

  const int64_t big_n = absl::GetFlag(FLAGS_sequences), ref_n = absl::GetFlag(FLAGS_reference_sequences);
  const int samples = absl::GetFlag(FLAGS_samples), rounds = absl::GetFlag(FLAGS_rounds);
  const int active = absl::GetFlag(FLAGS_active);
  if (big_n < 1 || ref_n < 1 || samples < 1 || rounds < 1 || active < 1) Die("flags must be >= 1");
  const int64_t headroom = static_cast<int64_t>(rounds) * samples * 4 + active + kReapPhaseMaxSamples;
  std::printf("sequence_scale_bench: %lld vs %lld sequences, %d samples x %d rounds per phase, %d active, "
              "%u cores, load average %.2f\n",
              static_cast<long long>(big_n), static_cast<long long>(ref_n), samples, rounds, active,
              std::thread::hardware_concurrency(), LoadAverage());

  KvCacheServer::Options options;
  AddPool(options.config, "ref", ref_n, active, headroom);
  AddPool(options.config, "big", big_n, active, headroom);
  options.default_device = "cpu";
  absl::StatusOr<std::unique_ptr<KvCacheServer>> created = KvCacheServer::Create(options);
  if (!created.ok()) Die(std::string(created.status().message()));
  KvCacheServer& server = **created;
  Pool& big_pool = *server.pools()[1];
  std::shared_ptr<grpc::Channel> channel = server.InProcessChannel();
  auto stub = v1::KvCache::NewStub(channel);
  auto health = grpc::health::v1::Health::NewStub(channel);

  const Row row = RandomRow();
  const MemoryUse m0 = ReadMemory();
  Fill(*stub, "ref", ref_n, row);
  malloc_trim(0);
  const MemoryUse m1 = ReadMemory();
  const Clock::time_point f0 = Clock::now();
  Fill(*stub, "big", big_n, row);
  const double fill_s = Micros(Clock::now() - f0) * 1e-6;
  const absl::Time fill_end = absl::Now();
  malloc_trim(0);
  const MemoryUse m2 = ReadMemory();
  std::printf("fill of %lld sequences: %.1f s (%.0f sequences/s)\n\n", static_cast<long long>(big_n), fill_s,
              big_n / fill_s);

  std::vector<Target> targets;
  targets.push_back(MakeTarget("ref", ref_n, active, row));
  targets.push_back(MakeTarget("big", big_n, active, row));
  for (Target& t : targets) {
    for (size_t i = 0; i < t.active.size(); ++i) AppendOnce(*stub, t);  // warm-up; marks them used after the fill
  }

  PhaseResult results[2][4];
  for (int r = 0; r < rounds; ++r) {
    for (int p = 0; p < 4; ++p) {
      for (int t = 0; t < 2; ++t) RunPhase(*stub, *health, targets[t], kLoads[p], samples, results[t][p]);
    }
  }
  std::printf("### Pool calls without gRPC (nothing else running): about how long each holds the pool lock, us\n\n");
  std::printf("| pool | sequences | call | p50 | p99 | max |\n|---|---|---|---|---|---|\n");
  PrintDirectCalls(targets[0], *server.pools()[0]);
  PrintDirectCalls(targets[1], big_pool);

  int freed = 0;
  double reap_s = 0;
  PhaseResult reap;
  reap.appends = RunReapPhase(*stub, targets[1], big_pool, fill_end + absl::Seconds(kIdleTtlSeconds), &freed, &reap_s);
  reap.round_p50.push_back(Median(reap.appends));
  // Again, to see the reaper's lock holds themselves: refill (other ids, so
  // the active sequences stay as they are) and reap with a lock probe.
  Fill(*stub, "big", big_n, row, "refill");
  const absl::Time refill_end = absl::Now();
  const ReaperHolds holds = MeasureReaperHolds(big_pool, refill_end + absl::Seconds(kIdleTtlSeconds));

  std::printf("\n### 1-row Append latency, us (in-process channel, call to status)\n\n");
  std::printf("| pool | sequences | phase | samples | p50 | p90 | p99 | max | p50 range over rounds |\n"
              "|---|---|---|---|---|---|---|---|---|\n");
  for (int p = 0; p < 4; ++p) {
    for (int t = 0; t < 2; ++t) PrintAppendRow(targets[t], LoadName(kLoads[p]), results[t][p]);
  }
  PrintAppendRow(targets[1], "d  reaper freeing (FreeIdle)", reap);
  std::printf("\nbig / ref:");
  for (int p = 0; p < 4; ++p) {
    const Summary b = Summarize(results[1][p].appends), a = Summarize(results[0][p].appends);
    std::printf(" %s p50 %.2fx p99 %.2fx;", LoadName(kLoads[p]), b.p50 / a.p50, b.p99 / a.p99);
  }
  std::printf("\nreaper: freed %d sequences in %.2f s (%.0f per s, %.2f ms per 1024 sequences, logging included)\n",
              freed, reap_s, freed / reap_s, reap_s * 1e3 / std::max(1.0, freed / 1024.0));

  PrintReaperHolds(holds, big_n);

  std::printf("\n### Each poll call's own latency, us\n\n");
  std::printf("| pool | sequences | poller | calls | calls/s | p50 | p90 | p99 | max | |\n"
              "|---|---|---|---|---|---|---|---|---|---|\n");
  for (int p = 1; p < 4; ++p) {
    for (int t = 0; t < 2; ++t) PrintPollRow(targets[t], kLoads[p], results[t][p], rounds);
  }

  std::printf("\n### Memory after the fill (malloc_trim(0) first)\n\n");
  std::printf("| pool | sequences | RSS growth | RSS per sequence | minus the %llu cache bytes of its token | "
              "heap in use per sequence |\n|---|---|---|---|---|---|\n",
              static_cast<unsigned long long>(kCacheBytesPerToken));
  PrintMemory("ref", ref_n, m0, m1);
  PrintMemory("big", big_n, m1, m2);
  std::printf("\nload average at the end: %.2f\n", LoadAverage());
  return 0;
}

}  // namespace
}  // namespace mlakv::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return mlakv::bench::Main();
}
