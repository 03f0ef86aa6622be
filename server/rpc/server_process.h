// ServerProcess: the parts of a running mlakv-server, built one component at a
// time from its flags, and the order they stop in. main.cc only parses flags,
// sets up logging and waits for SIGTERM/SIGINT.
//
// Start-up is two steps so the exit status says whose mistake it was:
//   PrepareServer   reads what the operator wrote: the config file, the
//                   device, TLS files and the token (errors: exit 2);
//   ServerProcess::Start
//                   acquires what the host must give: pool memory, the
//                   gRPC, metrics and health ports (errors: exit 1).
// Drain stops them in the order the pieces depend on each other
// (docs/server.md, "SIGTERM / SIGINT").
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "mlakv/v1/config.pb.h"
#include "server/observability/health_probe_server.h"
#include "server/observability/metrics_endpoint.h"
#include "server/observability/server_metrics.h"
#include "server/rpc/kv_cache_server.h"
#include "server/events/zmq_publisher.h"
#include "server/security/server_credentials.h"

namespace mlakv::server {

// Most threads --rpc_threads may ask for.
inline constexpr int kMaxRpcThreads = 256;

// The command line, as main.cc parsed it (flag help: server/main.cc).
struct ServerFlags {
  std::string config_path{};  // empty: the embedded default
  std::string listen{};       // empty: the config's listen, else kDefaultListen
  std::string device = "auto";
  bool allow_ipc = false;
  int rpc_threads = 0;           // threads of the completion queue; 0: the default
  std::string server_id{};       // empty: the host name
  std::string metrics_listen{};  // empty: no /metrics endpoint
  std::string health_listen{};   // empty: no probe port
  // KV events on ZeroMQ in vLLM's format (server/events/zmq_publisher.h);
  // empty endpoint: none.
  std::string kv_events_endpoint{}, kv_events_replay_endpoint{}, kv_events_topic{};
  std::string tls_cert{}, tls_key{}, tls_client_ca{}, auth_token_file{};
  std::string version{};  // the build's version, for logs and mlakv_build_info
};

// What the flags and files say, checked; nothing is listening yet.
struct PreparedServer {
  std::string config_source;  // the path, or "embedded default"
  v1::ServerConfig config;
  std::string listen;
  std::string device;
  bool allow_ipc = false;
  int rpc_threads = 0;
  std::string server_id;
  std::string metrics_listen, health_listen;
  std::string kv_events_endpoint, kv_events_replay_endpoint, kv_events_topic;
  std::string version;
  std::unique_ptr<ServerMetrics> metrics;
  ServerSecurityOptions security;  // its on_auth_failure counts into `metrics`
  std::shared_ptr<grpc::ServerCredentials> credentials;
};

// Loads and checks the config, the device and the credentials. Errors name
// the flag or file at fault.
absl::StatusOr<PreparedServer> PrepareServer(const ServerFlags& flags);

class ServerProcess {
 public:
  // Builds the KvCache server (its pools and port), then the side servers
  // that read it: /metrics and the health probe port.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(PreparedServer prepared);
  ~ServerProcess();

  // One info line per pool, the bound address, and the one-line summary
  // ("mlakv-server V ready: grpc ..., metrics ..., pools [...]").
  void LogReady() const;

  // SIGTERM: metrics and probes report the drain, the gRPC server drains
  // (calls in flight get `grace`), the side servers stop, then the pools go.
  void Drain(absl::Duration grace);

  // Before Drain.
  const KvCacheServer& server() const { return *server_; }
  int metrics_port() const { return metrics_endpoint_ ? metrics_endpoint_->port() : 0; }  // 0: off
  int health_port() const { return health_probe_ ? health_probe_->port() : 0; }           // 0: off

 private:
  explicit ServerProcess(PreparedServer prepared) : prepared_(std::move(prepared)) {}

  // ---- the builders of Start, in order ----
  absl::Status StartKvCacheServer();
  void ConnectPoolGauges();
  absl::Status StartMetricsEndpoint();
  absl::Status StartHealthProbe();
  absl::Status StartEventPublisher();

  PreparedServer prepared_;
  std::unique_ptr<KvCacheServer> server_;
  std::unique_ptr<MetricsEndpoint> metrics_endpoint_;  // null: --metrics_listen empty
  std::unique_ptr<HealthProbeServer> health_probe_;    // null: --health_listen empty
  std::unique_ptr<ZmqEventPublisher> events_publisher_;  // null: --kv_events_endpoint empty; before server_ goes
};

}  // namespace mlakv::server
