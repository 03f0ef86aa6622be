// ServerMetrics: the metric set of mlakv-server, on prometheus-cpp.
//
//   mlakv_build_info{version,allocator}                gauge, 1 (allocator: MallocLibrary())
//   mlakv_rpcs_total{service,method,code}              counter: finished RPCs
//   mlakv_rpc_errors_total{service,method,code}        counter: finished RPCs with code != OK
//   mlakv_rpc_latency_seconds{service,method}          histogram: receipt to status
//   mlakv_rpcs_in_flight{service,method}               gauge
//   mlakv_appended_rows_total{pool,method}             counter: rows written (per layer) by OK appends
//   mlakv_appended_bytes_total{pool,method}            counter: ckv + kpe bytes of OK appends
//   mlakv_append_latency_seconds{method}               histogram: Append / AppendBatch, any code
//   mlakv_kernel_seconds_total{pool,device}            counter: time in the backend's quantize-append
//   mlakv_kernel_calls_total{pool,device}              counter
//   mlakv_kernel_latency_seconds{pool,device}          histogram
//   mlakv_pool_pages_capacity/_used/_free{pool,device} gauges, read at scrape time
//   mlakv_pool_sequences{pool}, mlakv_pool_cache_bytes{pool,device}
//   mlakv_pool_pages_shared/_pages_indexed/_leases/_sequences_retained{pool}  gauges, at scrape time
//   mlakv_evictions_total, mlakv_evicted_pages_total, mlakv_idle_freed_sequences_total,
//   mlakv_leases_acquired/_released/_expired_total, mlakv_forks_total,
//   mlakv_fork_shared_pages_total, mlakv_pages_copied_total,
//   mlakv_prefix_queries_total, mlakv_prefix_hit_pages_total{pool}  counters, read from the pool at scrape time
//   mlakv_pool_worker_busy_seconds_total{pool}         counter: the pool's worker running tasks, at scrape time
//   mlakv_pool_worker_tasks{pool}                      gauge: tasks queued on or running on it, at scrape time
//   mlakv_transport_busy_seconds_total                 counter: the Append streams' transport threads' busy time
//   mlakv_transport_tasks                              gauge: tasks queued on or running on them
//   mlakv_ipc_regions                                  gauge: regions registered now, read at scrape time
//   mlakv_kv_events_recorded_total                     counter: KV events numbered, read at scrape time
//   mlakv_kv_events_kept, mlakv_kv_events_kept_bytes    gauges: the replay buffer, read at scrape time
//   mlakv_kv_events_watchers                           gauge: WatchEvents streams open, read at scrape time
//   mlakv_auth_failures_total{reason}                  counter: calls refused before the service
//   mlakv_draining                                     gauge: 1 after SIGTERM
//
// Every label value comes from a set fixed at start-up, so the number of
// series is bounded whatever clients send: service and method only name the
// methods the server registers (RpcMethodSet::Served(); any other path is
// service="unknown", method="unknown"), pool only names a configured pool
// (SetPools; any other name a request carries is pool="unknown"), code is a
// grpc::StatusCode name, reason is "missing" or "invalid" (bearer_token_auth),
// device and version are the server's own.
//
// The families live in a prometheus::Registry; the scrape-time gauges in a
// ScrapeTimeCollector. collectables() is what the /metrics endpoint serves.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/status.h"
#include "prometheus/collectable.h"
#include "server/observability/rpc_method_set.h"
#include "server/observability/scrape_time_collector.h"

namespace mlakv::server {

class ServerMetrics {
 public:

  // Errors: prometheus-cpp refusing a family (a bug in the names here).
  static absl::StatusOr<std::unique_ptr<ServerMetrics>> Create(const std::string& version);
  ~ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // What GET /metrics serializes, in this order, after the Exposer's own
  // exposer_* series (MetricsEndpoint::Options).
  std::vector<std::weak_ptr<prometheus::Collectable>> collectables() const;
  // The text exposition format of collectables() (tests).
  std::string Render() const;

  // Scrape-time sources (called on the metrics endpoint's threads; see
  // ScrapeTimeCollector).
  void SetPoolSource(std::function<std::vector<PoolSnapshot>()> source);
  void SetIpcRegionSource(std::function<int64_t()> source);
  void SetTransportSource(std::function<SerialExecutor::Load()> source);
  void SetEventsSource(std::function<ScrapeTimeCollector::EventsLoad()> source);
  // The pool an empty `pool` field of a request means.
  void SetDefaultPool(std::string name);
  std::string default_pool() const;
  // The configured pools: the only values of the append metrics' `pool`
  // label besides "unknown". Call at start-up; until then every pool name
  // counts as "unknown".
  void SetPools(const std::vector<std::string>& names);

  // `service` and `method` as the call's path names them ("/service/method");
  // a pair outside RpcMethodSet::Served() counts as ("unknown", "unknown").
  void RpcStarted(const std::string& service, const std::string& method);
  void RpcFinished(const std::string& service, const std::string& method, grpc::StatusCode code, double seconds);
  // The same through a method's metric children, resolved once per method
  // from its path ("/service/method") and kept: the per-call path does no
  // label lookup and no allocation (the interceptor's; every unary call pays
  // it, docs/performance.md "The RPC floor").
  struct RpcChildren;
  RpcChildren& ChildrenOf(absl::string_view path);
  void RpcStarted(RpcChildren& children);
  void RpcFinished(RpcChildren& children, grpc::StatusCode code, double seconds);
  // One Append / AppendBatch call, reported by the service
  // (KvCacheService::Options::on_append); rows and bytes count only when ok.
  // `pool` empty means the default pool; a pool that is not configured
  // counts as "unknown".
  void AppendFinished(const std::string& method, const std::string& pool, bool ok, uint64_t rows, uint64_t bytes,
                      double seconds);
  // `pool` and `device` are the server's own (InstrumentedBackend).
  void KernelRan(const std::string& pool, const std::string& device, double seconds);
  // `reason`: "missing" or "invalid" (BearerTokenAuth).
  void AuthFailed(const std::string& reason);
  void SetDraining(bool draining);

 private:
  struct Families;  // the prometheus families and their children (server_metrics.cc)

  ServerMetrics();
  // The label values a call is counted under.
  std::pair<std::string, std::string> RpcLabels(const std::string& service, const std::string& method) const;
  std::string PoolLabel(const std::string& pool) const;

  RpcChildren& ChildrenOfLabels(const std::string& service, const std::string& method)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(children_mu_);

  const RpcMethodSet methods_ = RpcMethodSet::Served();
  // Children per served path, and one entry every other path shares.
  absl::Mutex children_mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<RpcChildren>> children_ ABSL_GUARDED_BY(children_mu_);
  std::unique_ptr<RpcChildren> unknown_children_ ABSL_GUARDED_BY(children_mu_);
  std::shared_ptr<ScrapeTimeCollector> scrape_time_;
  std::unique_ptr<Families> families_;
  mutable absl::Mutex pools_mu_;
  std::string default_pool_ ABSL_GUARDED_BY(pools_mu_) = "default";
  absl::flat_hash_set<std::string> pools_ ABSL_GUARDED_BY(pools_mu_);
};

// "OK", "CANCELLED", ... "UNAUTHENTICATED" (the names of grpc::StatusCode).
std::string StatusCodeName(grpc::StatusCode code);

}  // namespace mlakv::server
