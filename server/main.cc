// mlakv-server: flags, logging, signals; ServerProcess (server/rpc/server_process.h) builds the rest.
#include <malloc.h>
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/security/openssl_exit.h"
#include "google/protobuf/stubs/logging.h"
#include "server/rpc/server_process.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, listen, "",
          "host:port to serve on (empty: the config's listen, else 127.0.0.1:50051); port 0 picks a free port, "
          "logged as 'listening on HOST:PORT'. Overrides the config's listen.");
ABSL_FLAG(std::string, device, "auto",
          "device for pools that name none: auto (cuda:0 if a GPU is visible, else cpu), cpu, or cuda:N");
ABSL_FLAG(std::string, config, "",
          "ServerConfig in protobuf text format (proto/mlakv/v1/config.proto); empty: the embedded default pool "
          "(61 layers, page size 64, 256 pages, scales set by the first append)");
ABSL_FLAG(std::string, log_level, "info", "trace, debug (one line per request), info, warn, error, off");
ABSL_FLAG(int32_t, drain_grace_s, 10,
          "on SIGTERM/SIGINT, how long calls in flight may run before they are cancelled (keep it below the pod's "
          "terminationGracePeriodSeconds)");
ABSL_FLAG(std::string, server_id, "",
          "this server's id in GetPool, ListPools and its KV events (empty: the host name; in Kubernetes the pod "
          "name, docs/deploy.md)");
ABSL_FLAG(std::string, kv_events_endpoint, "",
          "publish KV events on ZeroMQ in vLLM's KV event format (msgpack batches on a PUB socket), e.g. "
          "tcp://*:5557 (docs/events.md; port * picks a free one, named in the ready line); empty: off");
ABSL_FLAG(std::string, kv_events_replay_endpoint, "",
          "with --kv_events_endpoint: a ROUTER socket answering replay requests for missed batches, e.g. tcp://*:5558");
ABSL_FLAG(std::string, kv_events_topic, "", "with --kv_events_endpoint: the topic frame of every message");
ABSL_FLAG(bool, allow_ipc, false,
          "accept RegisterShmRegion / RegisterCudaRegion and appends naming regions: the server then reads memory "
          "of other processes on this host (docs/server.md \"Regions\"); off: those calls are PERMISSION_DENIED");
// ---- operations (docs/deploy.md): metrics, TLS, token, health probe port ----
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port serving Prometheus text metrics at GET /metrics (e.g. 0.0.0.0:9090; port 0 picks a free port, "
          "logged as 'metrics port N'); 4 connections served at once, each given 5 s to send its request; empty: no "
          "metrics endpoint");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: serve TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: mutual TLS, every client must present a certificate signed by it");
ABSL_FLAG(std::string, auth_token_file, "",
          "file holding a bearer token required on every RPC except grpc.health.v1.Health (needs TLS)");
ABSL_FLAG(int32_t, rpc_threads, 0,
          "threads serving the gRPC completion queue, every call of the main port (0: half the cores, 2 to 16; "
          "docs/server.md \"Threads\")");
ABSL_FLAG(std::string, health_listen, "",
          "host:port of a plaintext server with only grpc.health.v1.Health, for kubelet probes when the main port "
          "requires TLS; empty: none");
// ---- end operations ----

namespace mlakv::server {
namespace {

// protobuf writes its own lines to stderr, outside the log's format and
// --log_level: one "String field ... contains invalid UTF-8" line per bad
// message a client sends, which would let a client flood the log. The
// Append stream that carried it already logs one warning with its status, so
// protobuf's errors and warnings go to debug; fatal ones stay critical.
void ProtobufLogToSpdlog(google::protobuf::LogLevel level, const char* filename, int line,
                         const std::string& message) {
  if (level == google::protobuf::LOGLEVEL_FATAL) {
    spdlog::critical("protobuf {}:{}: {}", filename, line, message);
  } else {
    spdlog::debug("protobuf {}:{}: {}", filename, line, message);
  }
}

#ifndef MLAKV_VERSION
#define MLAKV_VERSION "unknown"
#endif

ServerFlags FlagsFromCommandLine() {
  return {.config_path = absl::GetFlag(FLAGS_config),
          .listen = absl::GetFlag(FLAGS_listen),
          .device = absl::GetFlag(FLAGS_device),
          .allow_ipc = absl::GetFlag(FLAGS_allow_ipc),
          .rpc_threads = absl::GetFlag(FLAGS_rpc_threads),
          .server_id = absl::GetFlag(FLAGS_server_id),
          .metrics_listen = absl::GetFlag(FLAGS_metrics_listen),
          .health_listen = absl::GetFlag(FLAGS_health_listen),
          .kv_events_endpoint = absl::GetFlag(FLAGS_kv_events_endpoint),
          .kv_events_replay_endpoint = absl::GetFlag(FLAGS_kv_events_replay_endpoint),
          .kv_events_topic = absl::GetFlag(FLAGS_kv_events_topic),
          .tls_cert = absl::GetFlag(FLAGS_tls_cert),
          .tls_key = absl::GetFlag(FLAGS_tls_key),
          .tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca),
          .auth_token_file = absl::GetFlag(FLAGS_auth_token_file),
          .version = MLAKV_VERSION};
}

// Exit status: 0 after a drain, 2 for flags or files the operator must fix,
// 1 when the host refused something (a port in use, pool memory).
int RunServer() {
  // Block the stop signals in every thread (gRPC's included); this thread
  // waits for them with sigwait.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);

  absl::StatusOr<PreparedServer> prepared = PrepareServer(FlagsFromCommandLine());
  if (!prepared.ok()) {
    spdlog::critical("{}", std::string(prepared.status().message()));
    return 2;
  }
  absl::StatusOr<std::unique_ptr<ServerProcess>> process = ServerProcess::Start(std::move(*prepared));
  if (!process.ok()) {
    spdlog::critical("{}", std::string(process.status().message()));
    return 1;
  }
  (*process)->LogReady();

  int signal = 0;
  sigwait(&stop, &signal);
  spdlog::info("received {}", signal == SIGTERM ? "SIGTERM" : "SIGINT");
  (*process)->Drain(absl::Seconds(absl::GetFlag(FLAGS_drain_grace_s)));
  process->reset();
  spdlog::info("stopped");
  return 0;
}

}  // namespace
}  // namespace mlakv::server

int main(int argc, char** argv) {
  // Before anything touches OpenSSL: gRPC's threads outlive main
  // (common/openssl_exit.h).
  mlakv::KeepOpenSslStateAtExit();
  // Rows arrive as multi-megabyte protobuf strings and gRPC slices. glibc
  // serves blocks that large with fresh mmaps and trims freed heap back to the
  // kernel, so every 4 MB message paid ~1000 zero-filled page faults on the
  // way in (half of an Append's time on a 4 MB message, docs/performance.md).
  // Keep such blocks in the heap: up to 256 MB per allocation, trimmed only
  // past 512 MB free per arena. GLIBC_TUNABLES set by an operator still wins.
  // This applies where glibc's malloc serves the server (-DMLAKV_ALLOCATOR=system,
  // sanitizer builds); with tcmalloc linked (the default, cmake/allocator.cmake)
  // mallopt is tcmalloc's and does nothing: its page heap keeps freed spans.
  // Debian's abseil checks every Mutex acquisition for lock-order cycles
  // through one process-wide lock (35-47 ns per uncontended Lock/Unlock
  // against 11 ns without, docs/performance.md); the server's locks are
  // checked by the tests' builds instead.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (std::getenv("GLIBC_TUNABLES") == nullptr) {
    mallopt(M_MMAP_THRESHOLD, 256 << 20);
    mallopt(M_TRIM_THRESHOLD, 512 << 20);
  }
  // --version: the repository's VERSION (also the CLI's and the Python package's).
  absl::FlagsUsageConfig usage_config;
  usage_config.version_string = [] { return std::string("mlakv-server " MLAKV_VERSION "\n"); };
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "mlakv-server: gRPC service owning NVFP4 MLA paged KV-cache pools.\n"
      "  mlakv-server                       embedded default pool on --device=auto, 127.0.0.1:50051\n"
      "  mlakv-server --listen 0.0.0.0:50051 --device cuda:0 --config pools.txtpb");
  absl::ParseCommandLine(argc, argv);
  auto logger = spdlog::stderr_color_mt("mlakv");
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%eZ %^%l%$ %v", spdlog::pattern_time_type::utc);
  const spdlog::level::level_enum level = spdlog::level::from_str(absl::GetFlag(FLAGS_log_level));
  if (level == spdlog::level::off && absl::GetFlag(FLAGS_log_level) != "off") {
    std::fprintf(stderr, "--log_level '%s' is not one of trace, debug, info, warn, error, off\n",
                 absl::GetFlag(FLAGS_log_level).c_str());
    return 2;
  }
  spdlog::set_level(level);
  spdlog::flush_on(spdlog::level::info);
  google::protobuf::SetLogHandler(&mlakv::server::ProtobufLogToSpdlog);
  return mlakv::server::RunServer();
}
