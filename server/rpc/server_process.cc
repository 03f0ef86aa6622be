#include "server/rpc/server_process.h"

#include <unistd.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/backend/device.h"
#include "server/observability/malloc_library.h"
#include "common/status_macros.h"
#include "server/rpc/proto_convert.h"
#include "server/rpc/server_config.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {
namespace {

std::string HumanBytes(uint64_t bytes) {
  if (bytes >= (1ull << 30)) return absl::StrCat(absl::SixDigits(bytes / double(1ull << 30)), " GiB");
  return absl::StrCat(absl::SixDigits(bytes / double(1ull << 20)), " MiB");
}

absl::Status WithPrefix(absl::string_view prefix, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(prefix, status.message()));
}

}  // namespace

absl::StatusOr<PreparedServer> PrepareServer(const ServerFlags& flags) {
  PreparedServer p;
  p.version = flags.version;
  p.config_source = flags.config_path.empty() ? "embedded default" : flags.config_path;
  if (flags.config_path.empty()) {
    p.config = DefaultServerConfig();
  } else {
    MLAKV_ASSIGN_OR_RETURN(p.config, LoadServerConfig(flags.config_path));
  }
  p.listen = !flags.listen.empty() ? flags.listen : !p.config.listen().empty() ? p.config.listen() : kDefaultListen;
  if (absl::StatusOr<Device> device = Device::Parse(flags.device); !device.ok()) {
    return WithPrefix("--device: ", device.status());
  }
  p.device = flags.device;
  p.allow_ipc = flags.allow_ipc;
  if (flags.rpc_threads < 0 || flags.rpc_threads > kMaxRpcThreads) {
    return absl::InvalidArgumentError(absl::StrCat("--rpc_threads ", flags.rpc_threads, " is outside 0..",
                                                   kMaxRpcThreads, " (0: half the cores, 2 to 16)"));
  }
  p.rpc_threads = flags.rpc_threads;
  p.server_id = flags.server_id;
  if (p.server_id.size() > kMaxServerIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--server_id is ", p.server_id.size(), " bytes; at most ",
                                                   kMaxServerIdBytes, " are accepted"));
  }
  if (p.server_id.empty()) {
    char host[256] = {};
    p.server_id = gethostname(host, sizeof(host) - 1) == 0 ? host : "unknown";
  }
  p.metrics_listen = flags.metrics_listen;
  p.kv_events_endpoint = flags.kv_events_endpoint;
  p.kv_events_replay_endpoint = flags.kv_events_replay_endpoint;
  p.kv_events_topic = flags.kv_events_topic;
  if (p.kv_events_endpoint.empty() && !p.kv_events_replay_endpoint.empty()) {
    return absl::InvalidArgumentError("--kv_events_replay_endpoint needs --kv_events_endpoint");
  }
  p.health_listen = flags.health_listen;

  absl::StatusOr<std::unique_ptr<ServerMetrics>> metrics = ServerMetrics::Create(flags.version);
  if (!metrics.ok()) return WithPrefix("metrics: ", metrics.status());
  p.metrics = std::move(*metrics);
  p.security = {.tls_cert_file = flags.tls_cert,
                .tls_key_file = flags.tls_key,
                .tls_client_ca_file = flags.tls_client_ca,
                .auth_token_file = flags.auth_token_file,
                .on_auth_failure = [m = p.metrics.get()](const std::string& reason) {
                  m->AuthFailed(reason);
                  spdlog::warn("refused a call: bearer token {}", reason);
                }};
  MLAKV_ASSIGN_OR_RETURN(p.credentials, BuildServerCredentials(p.security));
  return p;
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(PreparedServer prepared) {
  std::unique_ptr<ServerProcess> process(new ServerProcess(std::move(prepared)));
  MLAKV_RETURN_IF_ERROR(process->StartKvCacheServer());
  MLAKV_RETURN_IF_ERROR(process->StartEventPublisher());
  process->ConnectPoolGauges();  // reads the server and the publisher; the endpoint goes before them
  MLAKV_RETURN_IF_ERROR(process->StartMetricsEndpoint());
  MLAKV_RETURN_IF_ERROR(process->StartHealthProbe());
  return process;
}

ServerProcess::~ServerProcess() {
  // The side servers read the pools: they go first (Drain did it already on
  // the normal path; an early return from Start gets here).
  metrics_endpoint_.reset();
  health_probe_.reset();
  events_publisher_.reset();  // follows the server's event log
  server_.reset();
}

absl::Status ServerProcess::StartKvCacheServer() {
  absl::StatusOr<std::unique_ptr<KvCacheServer>> server =
      KvCacheServer::Create({.config = prepared_.config,
                             .listen = prepared_.listen,
                             .default_device = prepared_.device,
                             .allow_ipc = prepared_.allow_ipc,
                             .server_id = prepared_.server_id,
                             .credentials = prepared_.credentials,
                             .metrics = prepared_.metrics.get(),
                             .rpc_threads = prepared_.rpc_threads});
  if (!server.ok()) return WithPrefix("cannot start: ", server.status());
  server_ = std::move(*server);
  return absl::OkStatus();
}

absl::Status ServerProcess::StartEventPublisher() {
  if (prepared_.kv_events_endpoint.empty()) return absl::OkStatus();
  const v1::EventsConfig& ev = prepared_.config.events();
  ZmqEventPublisher::Options o{
      .endpoint = prepared_.kv_events_endpoint,
      .replay_endpoint = prepared_.kv_events_replay_endpoint,
      .topic = prepared_.kv_events_topic,
      .replay_batches = ev.zmq_replay_batches() == 0 ? kDefaultZmqReplayBatches : ev.zmq_replay_batches(),
      .replay_bytes = ev.zmq_replay_bytes() == 0 ? kDefaultZmqReplayBytes : ev.zmq_replay_bytes(),
      .max_replays = ev.zmq_max_replays() == 0 ? kDefaultZmqMaxReplays : ev.zmq_max_replays(),
      .send_queue = static_cast<int>(ev.zmq_send_queue() == 0 ? kDefaultZmqSendQueue : ev.zmq_send_queue())};
  for (const auto& pool : server_->pools()) o.medium_of_pool[pool->name()] = pool->device().is_cuda() ? "GPU" : "CPU";
  MLAKV_ASSIGN_OR_RETURN(events_publisher_, ZmqEventPublisher::Start(std::move(o), &server_->events()));
  return absl::OkStatus();
}

// Pool gauges, the region count and the KV events' buffer are read when
// Prometheus scrapes, not pushed on every change.
void ServerProcess::ConnectPoolGauges() {
  prepared_.metrics->SetPoolSource([s = server_.get()] {
    std::vector<PoolSnapshot> out;
    for (const auto& pool : s->pools()) {
      out.push_back(pool->Snapshot());
      out.back().worker = pool->worker().load();
    }
    return out;
  });
  prepared_.metrics->SetIpcRegionSource([s = server_.get()] { return static_cast<int64_t>(s->regions().size()); });
  prepared_.metrics->SetTransportSource([s = server_.get()] { return s->service().TransportLoad(); });
  prepared_.metrics->SetEventsSource([s = server_.get(), zmq = events_publisher_.get()] {
    return ScrapeTimeCollector::EventsLoad{
        .log = s->events().stats(),
        .watchers = s->service().watchers(),
        .zmq = zmq != nullptr ? std::optional<EventPublisherStats>(zmq->stats()) : std::nullopt};
  });
}

absl::Status ServerProcess::StartMetricsEndpoint() {
  if (prepared_.metrics_listen.empty()) return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<MetricsEndpoint>> endpoint =
      MetricsEndpoint::Create({.listen = prepared_.metrics_listen, .collectables = prepared_.metrics->collectables()});
  if (!endpoint.ok()) return WithPrefix("--metrics_listen: ", endpoint.status());
  metrics_endpoint_ = std::move(*endpoint);
  return absl::OkStatus();
}

absl::Status ServerProcess::StartHealthProbe() {
  if (prepared_.health_listen.empty()) return absl::OkStatus();
  MLAKV_ASSIGN_OR_RETURN(health_probe_, HealthProbeServer::Create(prepared_.health_listen));
  return absl::OkStatus();
}

void ServerProcess::LogReady() const {
  spdlog::info("mlakv-server {} (config: {}, malloc: {})", prepared_.version, prepared_.config_source, MallocLibrary());
  std::string pools;
  uint64_t total_bytes = 0;
  for (const auto& pool : server_->pools()) {
    const PoolSnapshot p = pool->Snapshot();
    int fixed = 0;
    for (const LayerSnapshot& l : p.layers) fixed += l.scales_from_config ? 1 : 0;
    spdlog::info("pool '{}': device {}, {} layers, {} pages x {} tokens, {} cache bytes ({}), scales fixed for {} of {} "
                 "layers",
                 p.name, p.device.ToString(), p.num_layers, p.pages_total, p.page_size, p.cache_bytes,
                 HumanBytes(p.cache_bytes), fixed, p.num_layers);
    absl::StrAppend(&pools, pools.empty() ? "" : ", ", p.name, "@", p.device.ToString(), " ", p.pages_total, "x",
                    p.page_size, "x", p.num_layers, "L ", HumanBytes(p.cache_bytes));
    total_bytes += p.cache_bytes;
  }
  // This line's form is an interface (docs/server.md): nothing after the port.
  spdlog::info("listening on {}", server_->bound_address());
  std::string kv_events = "off";
  if (events_publisher_) {
    kv_events = events_publisher_->bound_endpoint();
    if (!events_publisher_->bound_replay_endpoint().empty()) {
      absl::StrAppend(&kv_events, " replay ", events_publisher_->bound_replay_endpoint());
    }
  }
  spdlog::info("mlakv-server {} ready: grpc {} ({}, {} rpc threads), metrics {}, health probe {}, kv events {}, "
               "pools [{}], cache {} ({} bytes)",
               prepared_.version, server_->bound_address(), DescribeSecurity(prepared_.security),
               server_->rpc_threads(),
               metrics_endpoint_ ? absl::StrCat("port ", metrics_endpoint_->port()) : std::string("off"),
               health_probe_ ? absl::StrCat("port ", health_probe_->port()) : std::string("off"), kv_events, pools,
               HumanBytes(total_bytes), total_bytes);
  spdlog::default_logger()->flush();
}

void ServerProcess::Drain(absl::Duration grace) {
  prepared_.metrics->SetDraining(true);
  if (health_probe_) health_probe_->SetServing(false);
  server_->Shutdown(grace);
  metrics_endpoint_.reset();
  health_probe_.reset();
  events_publisher_.reset();  // follows the server's event log
  server_.reset();
}

}  // namespace mlakv::server
