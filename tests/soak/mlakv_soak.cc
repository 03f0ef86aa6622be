// mlakv_soak: a long random workload with faults against a real
// mlakv-server that checks, continuously, that the server keeps the promises
// of docs/server.md ("Model", "Atomicity", "Errors") and docs/reliability.md
// (whose section "Soak" describes this program in full).
//
// Usage:
//   # start a server itself (cpu backend), 30 minutes, 8 clients:
//   build/tests/soak/mlakv_soak --spawn build/server/mlakv-server --device cpu
//       --duration_s 1800 --seed 7 --report soak-cpu.json
//   # the GPU machine (binaries bundled with ../shared/device/bundle-runtime.sh), 10 minutes:
//   mlakv_soak --spawn "$(command -v mlakv-server)" --device cuda:0 --duration_s 600 --report soak-gpu.json
//   # a server already running (its pool must have config-fixed scales and
//   # match --max_message_bytes / --idle_timeout_s; --server_pid for RSS):
//   mlakv_soak --server 127.0.0.1:50051 --pool soak --max_message_bytes 1048576
//       --idle_timeout_s 1 --server_pid $(pidof mlakv-server)
//
// What runs: --clients threads, each with its own connections and its own
// sequence ids, keep a model per sequence (the stored bytes of every
// committed position, computed with the CPU quantizer of kernels/, and the
// pages) and run random operations — appends of 1-4 messages over several
// layers (rewrites, overlaps, expect_length, reserve_tokens, mixed dtypes,
// the layer's own scales named or not), the C++ client's Append,
// AppendBatch, byte-exact read-backs (RAW, ranged, DEQUANTIZED), GetSequence,
// free, truncate (to 0 included), and NOT_FOUND probes — checking every
// response against the model. A share of the steps (--fault_fraction) are
// faults, each followed by a check of the sequence (tests/soak/fault_injector.h
// says which outcome each may have). Every --check_interval_s the clients
// park with no call in flight and the pool is audited (pool_auditor.h). At
// the end every sequence is read back, then freed, the pool must be back
// where it was, and a spawned server must exit 0 on SIGTERM and have logged
// nothing at error.
//
// Output: the report on stdout (and --report FILE as JSON); each violation
// on stderr as it is found. Exit status 0 only with no violation, no
// failure, and (spawned) a clean server exit. --seed makes the operations
// reproducible (their outcomes still depend on timing).
//
// Memory stays bounded however long it runs: each client keeps at most
// --sequences_per_client sequences of at most --max_tokens tokens per layer.

#include <unistd.h>

#include <atomic>
#include <fstream>
#include <iostream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/kv_cache_client.h"
#include "common/status_macros.h"
#include "google/protobuf/text_format.h"
#include "mlakv/v1/config.pb.h"
#include "tests/soak/pause_barrier.h"
#include "tests/soak/pool_auditor.h"
#include "tests/soak/soak_client.h"
#include "tests/soak/soak_report.h"
#include "tests/soak/spawned_server.h"

ABSL_FLAG(std::string, server, "", "HOST:PORT of a running mlakv-server (or --spawn)");
ABSL_FLAG(std::string, spawn, "", "path to mlakv-server: start it on 127.0.0.1:0 with a config written here");
ABSL_FLAG(std::string, device, "cpu", "--device of a spawned server (cpu, cuda:0, ...)");
ABSL_FLAG(int32_t, clients, 8, "client threads");
ABSL_FLAG(double, duration_s, 60, "seconds during which clients start operations");
ABSL_FLAG(uint64_t, seed, 1, "random seed (client i uses a stream derived from seed and i)");
ABSL_FLAG(std::string, report, "", "write the report as JSON to this file");
ABSL_FLAG(int32_t, server_pid, 0, "pid of a --server for RSS readings (spawned: known)");
ABSL_FLAG(std::string, pool, "", "pool to use (spawned: 'soak'; --server: empty = the server's default pool)");
ABSL_FLAG(uint32_t, max_message_bytes, 1u << 20, "the server's max_message_bytes (set so when spawned)");
ABSL_FLAG(uint32_t, idle_timeout_s, 1, "the server's append_idle_timeout_seconds (set so when spawned)");
ABSL_FLAG(double, check_interval_s, 5, "seconds between quiescent checks");
ABSL_FLAG(int32_t, sequences_per_client, 6, "most sequences a client keeps at once");
ABSL_FLAG(uint32_t, max_tokens, 384, "most tokens per layer of a sequence");
ABSL_FLAG(double, fault_fraction, 0.2, "share of steps that inject a fault");
ABSL_FLAG(int32_t, sample_reads, 8, "sequences read back byte-exact at each quiescent check");
ABSL_FLAG(int32_t, max_violations, 100, "stop the run after this many violations");
ABSL_FLAG(int32_t, layers, 4, "spawned server: layers of the pool");
ABSL_FLAG(int32_t, page_size, 16, "spawned server: tokens per page");
ABSL_FLAG(double, self_check_corrupt_after_s, 0,
          "self-check: after this many seconds flip one byte of one model; the run must then fail (0: off)");
ABSL_FLAG(bool, keep_server_log, false, "spawned server: keep its scratch directory (log, config) even on success");

namespace mlakv::soak {
namespace {

// Config-fixed scales: every row's stored bytes can be computed here. Layer
// 1 differs from the rest, so that a row quantized with another layer's
// scales would show.
constexpr LayerScale kAllLayers{0.0625f, 0.03125f};
constexpr LayerScale kLayerOne{0.5f, 0.25f};

absl::Status Check(bool ok, absl::string_view what) {
  return ok ? absl::OkStatus() : absl::InvalidArgumentError(what);
}

SoakOptions OptionsFromFlags(bool spawned) {
  SoakOptions o;
  o.pool = absl::GetFlag(FLAGS_pool);
  if (o.pool.empty() && spawned) o.pool = "soak";
  o.clients = absl::GetFlag(FLAGS_clients);
  o.duration = absl::Seconds(absl::GetFlag(FLAGS_duration_s));
  o.seed = absl::GetFlag(FLAGS_seed);
  o.run_prefix = absl::StrCat("soak-", o.seed, "-", getpid(), "-");
  o.sequences_per_client = absl::GetFlag(FLAGS_sequences_per_client);
  o.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  o.fault_fraction = absl::GetFlag(FLAGS_fault_fraction);
  o.check_interval = absl::Seconds(absl::GetFlag(FLAGS_check_interval_s));
  o.sample_reads = absl::GetFlag(FLAGS_sample_reads);
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  o.idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_idle_timeout_s));
  o.max_violations = absl::GetFlag(FLAGS_max_violations);
  o.corrupt_model_after = absl::Seconds(absl::GetFlag(FLAGS_self_check_corrupt_after_s));
  return o;
}

absl::Status ValidateOptions(const SoakOptions& o) {
  MLAKV_RETURN_IF_ERROR(Check(o.clients >= 1, "--clients must be at least 1"));
  MLAKV_RETURN_IF_ERROR(Check(o.duration > absl::ZeroDuration(), "--duration_s must be positive"));
  MLAKV_RETURN_IF_ERROR(Check(o.sequences_per_client >= 2, "--sequences_per_client must be at least 2"));
  MLAKV_RETURN_IF_ERROR(Check(o.max_tokens >= 8, "--max_tokens must be at least 8"));
  MLAKV_RETURN_IF_ERROR(Check(o.fault_fraction >= 0 && o.fault_fraction <= 1, "--fault_fraction is in [0, 1]"));
  MLAKV_RETURN_IF_ERROR(Check(o.idle_timeout >= absl::Seconds(1), "--idle_timeout_s must be at least 1"));
  // The largest ordinary message (4 layers x 32 rows) must stay well under
  // the limit, and the oversized fault must still be a sane allocation.
  MLAKV_RETURN_IF_ERROR(Check(o.max_message_bytes >= (256u << 10) && o.max_message_bytes <= (64u << 20),
                              "--max_message_bytes must be in [256 KiB, 64 MiB]"));
  return absl::OkStatus();
}

// Pages the workload can hold at once: every client's sequences at their
// longest (or largest reservation), one more per client for a fault's
// sequence being created, and a margin for rollbacks still in flight.
uint32_t PagesNeeded(const SoakOptions& o, uint32_t page_size) {
  const uint32_t per_sequence = (o.max_tokens + page_size - 1) / page_size;
  return static_cast<uint32_t>(o.clients) * (o.sequences_per_client + 1) * per_sequence + 64;
}

std::string SpawnConfig(const SoakOptions& o, int layers, int page_size) {
  v1::ServerConfig config;
  config.set_max_message_bytes(o.max_message_bytes);
  config.set_append_idle_timeout_seconds(static_cast<uint32_t>(absl::ToInt64Seconds(o.idle_timeout)));
  v1::PoolConfig* pool = config.add_pools();
  pool->set_name(o.pool);
  pool->set_num_layers(layers);
  pool->set_page_size(page_size);
  pool->set_num_pages(PagesNeeded(o, page_size) * 5 / 4);
  pool->mutable_all_layers()->set_ckv_scale(kAllLayers.ckv);
  pool->mutable_all_layers()->set_kpe_scale(kAllLayers.kpe);
  if (layers > 1) {
    v1::LayerScaleConfig* one = pool->add_layer_scales();
    one->set_layer(1);
    one->set_ckv_scale(kLayerOne.ckv);
    one->set_kpe_scale(kLayerOne.kpe);
  }
  std::string text;
  google::protobuf::TextFormat::PrintToString(config, &text);
  return text;
}

// The pool's geometry and fixed scales, and what it holds before the soak.
absl::StatusOr<std::pair<PoolGeometry, PoolBaseline>> DescribePool(KvCacheClient& admin, const SoakOptions& o) {
  MLAKV_ASSIGN_OR_RETURN(v1::Pool pool, admin.GetPool(o.pool));
  PoolGeometry g;
  g.num_layers = static_cast<int>(pool.num_layers());
  g.page_size = pool.page_size();
  g.pages_total = pool.pages_total();
  PoolBaseline base;
  base.pages_used = pool.pages_used();
  base.sequences = pool.sequences();
  for (const v1::LayerScales& layer : pool.layers()) {
    if (!layer.set()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "pool '", pool.name(), "' layer ", layer.layer(),
          " has no scales: the soak needs them fixed by the config (all_layers { ckv_scale: .. kpe_scale: .. })"));
    }
    g.scales.push_back({layer.ckv_scale(), layer.kpe_scale()});
    base.tokens.push_back(layer.tokens());
  }
  const uint32_t needed = PagesNeeded(o, g.page_size);
  if (pool.pages_free() < needed) {
    return absl::FailedPreconditionError(absl::StrCat("pool '", pool.name(), "' has ", pool.pages_free(),
                                                      " free pages; this workload may hold ", needed,
                                                      " (fewer --clients, --sequences_per_client or --max_tokens)"));
  }
  return std::make_pair(g, base);
}

// Runs the clients until the end, auditing every check interval.
void RunClients(std::vector<std::unique_ptr<SoakClient>>& clients, PauseBarrier& barrier, PoolAuditor& auditor,
                const SoakOptions& o, pid_t pid, SoakReport& report, std::atomic<bool>& stop) {
  const absl::Time end = absl::Now() + o.duration;
  std::vector<std::thread> threads;
  for (auto& c : clients) threads.emplace_back([&c, end] { c->Run(end); });
  std::vector<const ClientSession*> sessions;
  for (auto& c : clients) sessions.push_back(&c->session());
  std::mt19937_64 rng(o.seed ^ 0x5eed);
  absl::Time next_check = absl::Now() + o.check_interval;
  while (absl::Now() < end && !stop.load()) {
    absl::SleepFor(std::min(absl::Seconds(1), std::max(absl::ZeroDuration(), std::min(end, next_check) - absl::Now())));
    report.SampleRss(ReadVmRssKb(pid));
    if (absl::Now() < next_check || absl::Now() >= end) continue;
    // Every call of every client ends within its deadline, so parking is bounded.
    if (barrier.Pause(o.call_timeout * 2 + o.settle_timeout)) {
      auditor.Audit(sessions, false, rng, ReadVmRssKb(pid));
    } else {
      report.Failure("the clients did not park for a quiescent check; a call outlived its deadline");
    }
    barrier.Resume();
    next_check = absl::Now() + o.check_interval;
  }
  for (std::thread& t : threads) t.join();
  // The last audit reads everything back, then every sequence is freed.
  auditor.Audit(sessions, true, rng, ReadVmRssKb(pid));
  for (auto& c : clients) c->FreeAll();
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage("mlakv_soak --spawn PATH | --server HOST:PORT [flags]; see the top of mlakv_soak.cc");
  absl::ParseCommandLine(argc, argv);
  const std::string spawn = absl::GetFlag(FLAGS_spawn), server_flag = absl::GetFlag(FLAGS_server);
  if (spawn.empty() == server_flag.empty()) {
    std::cerr << "mlakv_soak: give exactly one of --spawn PATH and --server HOST:PORT\n";
    return 2;
  }
  const SoakOptions options = OptionsFromFlags(!spawn.empty());
  if (absl::Status s = ValidateOptions(options); !s.ok()) {
    std::cerr << "mlakv_soak: " << s.message() << "\n";
    return 2;
  }
  SoakReport report;
  report.SetSeed(options.seed, options.clients);

  std::unique_ptr<SpawnedServer> spawned;
  std::string target = server_flag;
  pid_t pid = absl::GetFlag(FLAGS_server_pid);
  if (!spawn.empty()) {
    absl::StatusOr<std::unique_ptr<SpawnedServer>> started = SpawnedServer::Start(
        {.binary = spawn,
         .device = absl::GetFlag(FLAGS_device),
         .config_text = SpawnConfig(options, absl::GetFlag(FLAGS_layers), absl::GetFlag(FLAGS_page_size))});
    if (!started.ok()) {
      std::cerr << "mlakv_soak: " << started.status() << "\n";
      return 1;
    }
    spawned = *std::move(started);
    target = spawned->target();
    pid = spawned->pid();
  }
  report.SetServer(spawned ? "spawned" : "external", target, spawned ? absl::GetFlag(FLAGS_device) : "?");
  report.SampleRss(ReadVmRssKb(pid));

  KvCacheClient::Options admin_options;
  admin_options.target = target;
  admin_options.timeout = options.call_timeout;
  std::unique_ptr<KvCacheClient> admin = std::move(KvCacheClient::Create(admin_options).value());
  absl::StatusOr<std::pair<PoolGeometry, PoolBaseline>> described = DescribePool(*admin, options);
  if (!described.ok()) {
    std::cerr << "mlakv_soak: " << described.status() << "\n";
    return 1;
  }
  const PoolGeometry geometry = described->first;
  if (absl::StatusOr<v1::Pool> pool = admin->GetPool(options.pool); pool.ok()) {
    report.SetServer(spawned ? "spawned" : "external", target, pool->device());
  }

  PauseBarrier barrier(options.clients);
  std::atomic<bool> stop{false};
  std::vector<std::unique_ptr<SoakClient>> clients;
  for (int i = 0; i < options.clients; ++i) {
    absl::StatusOr<std::unique_ptr<ClientSession>> session =
        ClientSession::Create(i, target, options, geometry, &report);
    if (!session.ok()) {
      std::cerr << "mlakv_soak: client " << i << ": " << session.status() << "\n";
      return 1;
    }
    clients.push_back(std::make_unique<SoakClient>(*std::move(session), &barrier, &stop));
  }
  PoolAuditor auditor(admin.get(), options, geometry, &report, described->second);
  const absl::Time started = absl::Now();
  RunClients(clients, barrier, auditor, options, pid, report, stop);
  report.SetDuration(absl::Now() - started);
  if (absl::StatusOr<v1::Pool> final_pool = auditor.CheckEmptied(); final_pool.ok()) {
    report.SetFinalPool(*final_pool);
  } else {
    report.Failure(absl::StrCat("final GetPool: ", final_pool.status().ToString()));
  }
  report.SampleRss(ReadVmRssKb(pid));

  if (spawned) {
    absl::StatusOr<int> code = spawned->Stop(absl::Seconds(30));
    if (!code.ok()) {
      report.Failure(std::string(code.status().message()));
    } else {
      report.SetServerExit(*code);
      if (*code != 0) report.Failure(absl::StrCat("mlakv-server exited with ", *code, " after SIGTERM"));
    }
    for (const std::string& line : spawned->ErrorLines()) report.Violation("server log", line);
  }
  std::cout << report.ToText() << std::flush;
  if (const std::string path = absl::GetFlag(FLAGS_report); !path.empty()) {
    std::ofstream(path) << report.ToJson().dump(2) << "\n";
  }
  if (spawned) {
    // A failed run keeps the server's log, except the self-check's, which must fail.
    const bool self_check = options.corrupt_model_after > absl::ZeroDuration();
    if ((report.failed() && !self_check) || absl::GetFlag(FLAGS_keep_server_log)) {
      std::cout << "server log: " << spawned->log_path() << "\n";
    } else {
      spawned->RemoveScratch();
    }
  }
  return report.failed() ? 1 : 0;
}

}  // namespace
}  // namespace mlakv::soak

int main(int argc, char** argv) { return mlakv::soak::Main(argc, argv); }
