#include "server/rpc/kv_cache_server.h"

#include <algorithm>
#include <chrono>
#include <climits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "server/observability/instrumented_backend.h"
#include "server/observability/metrics_interceptor.h"
#include "server/regions/mapping_fault_guard.h"
#include "server/rpc/server_config.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {
namespace {

// "host:port" with the port replaced by `port`.
std::string WithPort(const std::string& listen, int port) {
  const size_t colon = listen.rfind(':');
  return absl::StrCat(colon == std::string::npos ? listen : listen.substr(0, colon), ":", port);
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvCacheServer>> KvCacheServer::Create(const Options& options) {
  MLAKV_ASSIGN_OR_RETURN(std::vector<Pool::Options> pool_options, PoolOptionsFromConfig(options.config, options.default_device));
  std::unique_ptr<KvCacheServer> server(new KvCacheServer());
  const v1::EventsConfig& ev = options.config.events();
  server->events_ = std::make_unique<EventLog>(EventLog::Options{
      .replay_capacity = ev.replay_capacity() == 0 ? kDefaultEventReplayCapacity : ev.replay_capacity(),
      .replay_bytes = ev.replay_bytes() == 0 ? kDefaultEventReplayBytes : ev.replay_bytes()});
  KvCacheService::Options service_options;
  const absl::Duration append_idle_timeout = absl::Seconds(options.config.append_idle_timeout_seconds() == 0
                                                               ? kDefaultAppendIdleTimeoutSeconds
                                                               : options.config.append_idle_timeout_seconds());
  for (Pool::Options& po : pool_options) {
    po.events = server->events_.get();
    po.source_timeout = append_idle_timeout;
    if (options.metrics != nullptr) {  // operations: time every quantize-append
      po.wrap_backend = [metrics = options.metrics, name = po.name](std::unique_ptr<CacheBackend> b) {
        return std::unique_ptr<CacheBackend>(std::make_unique<InstrumentedBackend>(std::move(b), name, metrics));
      };
    }
    MLAKV_ASSIGN_OR_RETURN(std::unique_ptr<Pool> pool, Pool::Create(po));
    service_options.pools.push_back(pool.get());
    server->pools_.push_back(std::move(pool));
  }
  // The default pool: the one named "default", else the first.
  service_options.default_pool = server->pools_.front()->name();
  for (const auto& pool : server->pools_) {
    if (pool->name() == kDefaultPoolName) service_options.default_pool = pool->name();
  }
  const uint32_t max_message =
      options.config.max_message_bytes() == 0 ? kDefaultMaxMessageBytes : options.config.max_message_bytes();
  if (max_message < (1u << 16)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_bytes ", max_message, " is below 65536; one row message needs more"));
  }
  service_options.max_message_bytes = max_message;
  const v1::ServerConfig& config = options.config;
  const uint32_t max_regions = config.max_regions() == 0 ? kDefaultMaxRegions : config.max_regions();
  if (max_regions > static_cast<uint32_t>(MappingFaultGuard::kMaxRanges)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_regions ", max_regions, " exceeds ", MappingFaultGuard::kMaxRanges));
  }
  // Checked here, not where the publisher starts, so that a config a later
  // --kv_events_endpoint would refuse is refused without one too.
  if (ev.zmq_send_queue() > kMaxZmqSendQueue) {
    return absl::InvalidArgumentError(absl::StrCat("events.zmq_send_queue ", ev.zmq_send_queue(), " exceeds ",
                                                   kMaxZmqSendQueue, " (batches of up to ~1 MiB each)"));
  }
  server->regions_ = std::make_unique<RegionRegistry>(RegionRegistry::Options{
      .allow_ipc = options.allow_ipc,
      .max_regions = max_regions,
      .max_region_bytes = config.max_region_bytes() == 0 ? kDefaultMaxRegionBytes : config.max_region_bytes()});
  service_options.regions = server->regions_.get();
  service_options.append_idle_timeout = append_idle_timeout;
  if (options.metrics != nullptr) {  // operations: rows and bytes of appends, by pool
    service_options.on_append = [metrics = options.metrics](const AppendOutcome& o) {
      metrics->AppendFinished(o.method, o.pool, o.ok, o.rows, o.bytes, o.seconds);
    };
  }
  service_options.events = server->events_.get();
  service_options.server_id = options.server_id;
  service_options.metrics = options.metrics;
  service_options.after_last_check_for_testing = options.after_last_check_for_testing;
  // A uint32 past INT_MAX would wrap to a negative limit that turns every watcher away.
  service_options.max_watchers =
      ev.max_watchers() == 0 ? kDefaultMaxWatchers : static_cast<int>(std::min<uint32_t>(ev.max_watchers(), INT_MAX));
  // A new server holds nothing: its first event says so, for routers that
  // knew an earlier process under the same id.
  server->events_->Record(KvEvent{.kind = KvEvent::Kind::kCleared});
  server->service_ = std::make_unique<KvCacheService>(service_options);
  // grpc.health.v1 ("" and the KvCache service) and server reflection, on the
  // same queue as the service: gRPC's default health service is a callback
  // service and its reflection a synchronous one, either of which would
  // bring threads of its own polling beside the queue's (kv_cache_service.h).
  const std::string kv_cache_name = v1::KvCache::service_full_name();
  server->health_ = std::make_unique<cq::HealthService>(std::vector<std::string>{kv_cache_name});
  server->reflection_ = std::make_unique<cq::ReflectionService>(std::vector<std::string>{
      kv_cache_name, grpc::health::v1::Health::service_full_name(),
      grpc::reflection::v1::ServerReflection::service_full_name(),
      grpc::reflection::v1alpha::ServerReflection::service_full_name()});
  server->unknown_ = std::make_unique<cq::UnknownMethods>(
      absl::StrCat(kv_cache_name, ", ", grpc::health::v1::Health::service_full_name(), " and server reflection"));

  grpc::ServerBuilder builder;
  // No receive limit in gRPC itself: the service enforces max_message_bytes
  // on every append message it is handed. gRPC's own limit would end an
  // Append stream whose next message is too large the same way as a clean
  // half-close (the cancellation it causes reaches the call only later), so
  // the messages before it could commit; and it bounds no memory, since gRPC
  // receives a whole message before it compares its size
  // (docs/reliability.md "Atomic streams").
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(static_cast<int>(std::min<uint32_t>(max_message, INT32_MAX)));
  builder.RegisterService(server->service_->grpc_service());
  builder.RegisterService(server->health_->service());
  builder.RegisterService(server->reflection_->v1_service());
  builder.RegisterService(server->reflection_->v1alpha_service());
  builder.RegisterAsyncGenericService(server->unknown_->service());  // cq/unknown_methods.h
  std::unique_ptr<grpc::ServerCompletionQueue> queue = builder.AddCompletionQueue();
  // ---- operations: per-RPC metrics, TLS / token credentials ----
  if (options.metrics != nullptr) {
    options.metrics->SetDefaultPool(service_options.default_pool);
    // The append metrics' pool label names only these; a request naming
    // any other pool counts as pool="unknown".
    std::vector<std::string> pool_names;
    for (const auto& pool : server->pools_) pool_names.push_back(pool->name());
    options.metrics->SetPools(pool_names);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(
        std::make_unique<MetricsInterceptorFactory>(options.metrics, KvCacheService::SelfRecordedPaths()));
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
  }
  // gRPC sets SO_REUSEPORT on Linux listeners by default, which lets a
  // second server bind a port already in use and take a share of its
  // connections: clients would see sequences appear and vanish. A port in
  // use is an error here instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  int port = 0;
  if (!options.listen.empty()) {
    builder.AddListeningPort(options.listen,
                             options.credentials ? options.credentials : grpc::InsecureServerCredentials(), &port);
  }
  server->server_ = builder.BuildAndStart();
  server->queue_ = std::make_unique<cq::QueueThreads>(
      std::move(queue), options.rpc_threads > 0 ? options.rpc_threads : cq::QueueThreads::DefaultThreads(), "rpc");
  if (server->server_ == nullptr || (!options.listen.empty() && port == 0)) {
    return absl::UnavailableError(absl::StrCat("cannot listen on '", options.listen,
                                               "' (address in use, or not host:port?)"));
  }
  server->queue_->Start();
  server->service_->Serve(server->queue_.get());
  server->health_->Serve(server->queue_.get());
  server->reflection_->Serve(server->queue_.get());
  server->unknown_->Serve(server->queue_.get());
  if (!options.listen.empty()) {
    server->bound_port_ = port;
    server->bound_address_ = WithPort(options.listen, port);
  }
  // SERVING for the whole server ("") and for the KvCache service by name;
  // Shutdown turns both NOT_SERVING.
  server->health_->SetServing(true);
  // The upkeep thread (Pool::Maintain: expired leases, the idle TTL, eviction
  // above the high watermark): every quarter of the shortest TTL, between
  // 0.1 s and 1 s (leases expire on every call that consults them as well).
  absl::Duration period = absl::Seconds(1);
  for (const auto& pool : server->pools_) {
    if (pool->idle_ttl() > absl::ZeroDuration()) period = std::min(period, pool->idle_ttl() / 4);
  }
  period = std::clamp(period, absl::Milliseconds(100), absl::Seconds(1));
  KvCacheServer* self = server.get();
  server->reaper_ = std::thread([self, period] {
    while (!self->stop_reaper_.WaitForNotificationWithTimeout(period)) {
      for (const auto& pool : self->pools_) pool->Maintain();
    }
  });
  return server;
}

KvCacheServer::~KvCacheServer() {
  Shutdown(absl::Seconds(5));
  if (!stop_reaper_.HasBeenNotified()) stop_reaper_.Notify();
  if (reaper_.joinable()) reaper_.join();
  // In this order: no call can reach the service once the grpc::Server is
  // shut down and the queue's calls have all ended, and no reactor is left
  // to post work to a pool once the service is.
  if (queue_ != nullptr) queue_->Shutdown();
  server_.reset();
  queue_.reset();
  unknown_.reset();
  reflection_.reset();
  health_.reset();
  service_.reset();
  regions_.reset();  // unmaps / closes every region (CUDA handles before the pools' contexts go)
  pools_.clear();  // each pool drains its worker, then frees its caches
}

std::shared_ptr<grpc::Channel> KvCacheServer::InProcessChannel() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return server_->InProcessChannel(args);
}

void KvCacheServer::Shutdown(absl::Duration grace) {
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  spdlog::info("shutting down: health NOT_SERVING, refusing new calls, draining calls in flight (grace {} s)",
               absl::ToDoubleSeconds(grace));
  health_->Shutdown();
  service_->StartDraining();
  events_->Close();  // WatchEvents streams end now (UNAVAILABLE), not at the grace's end
  // Appends in flight get the grace period to finish while the server keeps
  // answering new calls itself (UNAVAILABLE, "shutting down"); only then does
  // the grpc::Server shut down, with what is left of the grace for the rest.
  const absl::Time deadline = absl::Now() + grace;
  while (service_->appends_in_flight() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  server_->Shutdown(std::chrono::system_clock::now() +
                    absl::ToChronoMilliseconds(std::max(deadline - absl::Now(), absl::ZeroDuration())));
  server_->Wait();
  queue_->Shutdown();  // every call of the queue ended; then its threads
  spdlog::info("all calls finished");
}

}  // namespace mlakv::server
