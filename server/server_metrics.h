// ServerMetrics: the metric set of mlakv-server on one MetricsRegistry.
//
//   mlakv_build_info{version}                          gauge, 1
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
//   mlakv_ipc_regions                                  gauge (0 while IPC does not exist)
//   mlakv_auth_failures_total{reason}                  counter: calls refused before the service
//   mlakv_draining                                     gauge: 1 after SIGTERM
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/support/status.h"
#include "server/metrics.h"

namespace mlakv::server {

class ServerMetrics {
 public:
  // Occupancy of one pool, read at scrape time.
  struct PoolStats {
    std::string name;
    std::string device;
    uint64_t pages_total = 0;
    uint64_t pages_used = 0;
    uint64_t pages_free = 0;
    uint64_t sequences = 0;
    uint64_t cache_bytes = 0;
  };

  static absl::StatusOr<std::unique_ptr<ServerMetrics>> Create(const std::string& version);

  MetricsRegistry& registry() { return registry_; }
  std::string Render() const { return registry_.Render(); }

  // Scrape-time sources (called from the metrics thread).
  void SetPoolSource(std::function<std::vector<PoolStats>()> source);
  void SetIpcRegionSource(std::function<int64_t()> source);
  // The pool an empty `pool` field of a request means.
  void SetDefaultPool(std::string name) { default_pool_ = std::move(name); }
  const std::string& default_pool() const { return default_pool_; }

  void RpcStarted(const std::string& service, const std::string& method);
  void RpcFinished(const std::string& service, const std::string& method, grpc::StatusCode code, double seconds);
  // One Append / AppendBatch call; rows and bytes count only when ok.
  void AppendFinished(const std::string& method, const std::string& pool, bool ok, uint64_t rows, uint64_t bytes,
                      double seconds);
  void KernelRan(const std::string& pool, const std::string& device, double seconds);
  void AuthFailed(const std::string& reason);
  void SetDraining(bool draining);


 private:
  ServerMetrics() = default;

  MetricsRegistry registry_;
  std::string default_pool_ = "default";
  CounterFamily* rpcs_ = nullptr;
  CounterFamily* rpc_errors_ = nullptr;
  HistogramFamily* rpc_latency_ = nullptr;
  GaugeFamily* in_flight_ = nullptr;
  CounterFamily* rows_ = nullptr;
  CounterFamily* bytes_ = nullptr;
  HistogramFamily* append_latency_ = nullptr;
  CounterFamily* kernel_seconds_ = nullptr;
  CounterFamily* kernel_calls_ = nullptr;
  HistogramFamily* kernel_latency_ = nullptr;
  GaugeFamily* pages_total_ = nullptr;
  GaugeFamily* pages_used_ = nullptr;
  GaugeFamily* pages_free_ = nullptr;
  GaugeFamily* sequences_ = nullptr;
  GaugeFamily* cache_bytes_ = nullptr;
  GaugeFamily* ipc_regions_ = nullptr;
  CounterFamily* auth_failures_ = nullptr;
  GaugeFamily* draining_ = nullptr;
  std::function<std::vector<PoolStats>()> pool_source_;
  std::function<int64_t()> ipc_source_;
};

// "OK", "CANCELLED", ... "UNAUTHENTICATED" (the names of grpc::StatusCode).
const char* StatusCodeName(grpc::StatusCode code);

}  // namespace mlakv::server
