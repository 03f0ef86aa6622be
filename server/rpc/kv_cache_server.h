// KvCacheServer: the whole process minus flags and signals — pools built
// from a ServerConfig, the KvCache service, the health service and server
// reflection on one grpc::Server, all served by the threads of its one
// completion queue (cq/queue_threads.h). The --health_listen port's server
// (observability/health_probe_server.h) has health only.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "mlakv/v1/config.pb.h"
#include "server/cq/health_service.h"
#include "server/cq/queue_threads.h"
#include "server/cq/reflection_service.h"
#include "server/cq/unknown_methods.h"
#include "server/rpc/kv_cache_service.h"
#include "server/core/pool.h"
#include "server/regions/region_registry.h"
#include "server/observability/server_metrics.h"

namespace mlakv::server {

class KvCacheServer {
 public:
  struct Options {
    v1::ServerConfig config;             // pools, limits (an empty pool list: the embedded default pool)
    std::string listen;                  // host:port; port 0 picks a free port; empty: in-process only
    std::string default_device = "auto";  // for pools without a device: auto | cpu | cuda:N
    bool allow_ipc = false;  // --allow_ipc: shm / CUDA IPC regions (else their calls are PERMISSION_DENIED)
    std::string server_id;   // --server_id: in GetPool / ListPools and every event (empty: none)
    // ---- operations (docs/deploy.md) ----
    // Credentials of the listening port (server_credentials.h); null: plaintext.
    std::shared_ptr<grpc::ServerCredentials> credentials;
    // Per-RPC metrics (interceptor) and backend timing; null: none. Not owned.
    ServerMetrics* metrics = nullptr;
    // Threads serving the completion queue (--rpc_threads); 0: the default
    // (cq::QueueThreads::DefaultThreads()).
    int rpc_threads = 0;
    // ---- end operations ----
    // Tests only (KvCacheService::Options::after_last_check_for_testing).
    std::function<void()> after_last_check_for_testing;
  };

  static absl::StatusOr<std::unique_ptr<KvCacheServer>> Create(const Options& options);
  // Shuts down (if not done yet) and releases the pools.
  ~KvCacheServer();

  // "host:port" actually bound (the port resolved when 0 was asked); empty when in-process only.
  const std::string& bound_address() const { return bound_address_; }
  int bound_port() const { return bound_port_; }
  int rpc_threads() const { return queue_->threads(); }
  // A channel to this server that bypasses the network (tests).
  std::shared_ptr<grpc::Channel> InProcessChannel();
  const std::vector<std::unique_ptr<Pool>>& pools() const { return pools_; }
  KvCacheService& service() { return *service_; }
  const RegionRegistry& regions() const { return *regions_; }
  EventLog& events() { return *events_; }

  // Graceful drain: health NOT_SERVING, new calls refused (UNAVAILABLE), calls
  // in flight finish (or are cancelled after `grace`), then the pools' workers
  // drain. Idempotent.
  void Shutdown(absl::Duration grace);

 private:
  KvCacheServer() = default;

  // The KV events the pools record (before the pools: they record into it
  // until they are gone).
  std::unique_ptr<EventLog> events_;
  std::vector<std::unique_ptr<Pool>> pools_;
  std::unique_ptr<RegionRegistry> regions_;  // released after the service, before the pools
  std::unique_ptr<KvCacheService> service_;
  std::unique_ptr<cq::HealthService> health_;
  std::unique_ptr<cq::ReflectionService> reflection_;
  std::unique_ptr<cq::UnknownMethods> unknown_;
  std::unique_ptr<grpc::Server> server_;
  // After the server (its queue comes from the builder); shut down after the
  // server's Shutdown and before the services its calls use go.
  std::unique_ptr<cq::QueueThreads> queue_;
  std::string bound_address_;
  int bound_port_ = 0;
  bool shut_down_ = false;
  // Frees idle sequences of pools with an idle TTL (none: not started).
  absl::Notification stop_reaper_;
  std::thread reaper_;
};

}  // namespace mlakv::server
