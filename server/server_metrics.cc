#include "server/server_metrics.h"

#include <utility>

namespace mlakv::server {
namespace {

// Latency buckets, seconds: 100 us .. 30 s.
const std::vector<double> kLatencyBuckets = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                             0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    10, 30};

#define ASSIGN_OR_RETURN_METRIC(lhs, expr) \
  do {                                     \
    auto _r = (expr);                      \
    if (!_r.ok()) return _r.status();      \
    lhs = *_r;                             \
  } while (0)

}  // namespace

const char* StatusCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

absl::StatusOr<std::unique_ptr<ServerMetrics>> ServerMetrics::Create(const std::string& version) {
  std::unique_ptr<ServerMetrics> m(new ServerMetrics());
  MetricsRegistry& r = m->registry_;
  GaugeFamily* build_info = nullptr;
  ASSIGN_OR_RETURN_METRIC(build_info, r.AddGauge("mlakv_build_info", "mlakv-server version (always 1).", {"version"}));
  build_info->Set({version}, 1);
  ASSIGN_OR_RETURN_METRIC(m->rpcs_, r.AddCounter("mlakv_rpcs_total", "RPCs finished, by service, method and status code.",
                                                 {"service", "method", "code"}));
  ASSIGN_OR_RETURN_METRIC(m->rpc_errors_,
                          r.AddCounter("mlakv_rpc_errors_total", "RPCs finished with a status code other than OK.",
                                       {"service", "method", "code"}));
  ASSIGN_OR_RETURN_METRIC(m->rpc_latency_,
                          r.AddHistogram("mlakv_rpc_latency_seconds", "RPC time from receipt to status, seconds.",
                                         {"service", "method"}, kLatencyBuckets));
  ASSIGN_OR_RETURN_METRIC(m->in_flight_,
                          r.AddGauge("mlakv_rpcs_in_flight", "RPCs started and not finished.", {"service", "method"}));
  ASSIGN_OR_RETURN_METRIC(m->rows_, r.AddCounter("mlakv_appended_rows_total",
                                                 "Rows appended (one row = one token of one layer) by successful "
                                                 "Append and AppendBatch calls.",
                                                 {"pool", "method"}));
  ASSIGN_OR_RETURN_METRIC(m->bytes_, r.AddCounter("mlakv_appended_bytes_total",
                                                  "Input bytes (ckv + kpe, fp16/bf16) of successful appends.",
                                                  {"pool", "method"}));
  ASSIGN_OR_RETURN_METRIC(m->append_latency_,
                          r.AddHistogram("mlakv_append_latency_seconds",
                                         "Append and AppendBatch call time, first message to status, any outcome.",
                                         {"method"}, kLatencyBuckets));
  ASSIGN_OR_RETURN_METRIC(m->kernel_seconds_,
                          r.AddCounter("mlakv_kernel_seconds_total",
                                       "Seconds spent in the backend's quantize-append (CUDA: launch to stream "
                                       "synchronized, staging copies included).",
                                       {"pool", "device"}));
  ASSIGN_OR_RETURN_METRIC(m->kernel_calls_, r.AddCounter("mlakv_kernel_calls_total",
                                                         "Backend quantize-append calls.", {"pool", "device"}));
  ASSIGN_OR_RETURN_METRIC(m->kernel_latency_,
                          r.AddHistogram("mlakv_kernel_latency_seconds", "Backend quantize-append call time, seconds.",
                                         {"pool", "device"}, kLatencyBuckets));
  ASSIGN_OR_RETURN_METRIC(m->pages_total_, r.AddGauge("mlakv_pool_pages_capacity", "Pages in the pool (used + free).", {"pool", "device"}));
  ASSIGN_OR_RETURN_METRIC(m->pages_used_,
                          r.AddGauge("mlakv_pool_pages_used", "Pages owned by sequences.", {"pool", "device"}));
  ASSIGN_OR_RETURN_METRIC(m->pages_free_, r.AddGauge("mlakv_pool_pages_free", "Pages free.", {"pool", "device"}));
  ASSIGN_OR_RETURN_METRIC(m->sequences_, r.AddGauge("mlakv_pool_sequences", "Sequences alive in the pool.", {"pool"}));
  ASSIGN_OR_RETURN_METRIC(m->cache_bytes_, r.AddGauge("mlakv_pool_cache_bytes",
                                                      "Device bytes held by the pool's caches.", {"pool", "device"}));
  ASSIGN_OR_RETURN_METRIC(m->ipc_regions_,
                          r.AddGauge("mlakv_ipc_regions", "Regions (host shared memory and CUDA IPC) registered by producers.", {}));
  m->ipc_regions_->Set({}, 0);
  ASSIGN_OR_RETURN_METRIC(m->auth_failures_,
                          r.AddCounter("mlakv_auth_failures_total",
                                       "Calls refused with UNAUTHENTICATED before reaching the service "
                                       "(reason: missing or wrong bearer token).",
                                       {"reason"}));
  ASSIGN_OR_RETURN_METRIC(m->draining_, r.AddGauge("mlakv_draining", "1 while the server drains after SIGTERM.", {}));
  m->draining_->Set({}, 0);

  ServerMetrics* self = m.get();
  r.AddCollector([self] {
    if (self->pool_source_) {
      std::vector<PoolStats> pools = self->pool_source_();
      for (GaugeFamily* g : {self->pages_total_, self->pages_used_, self->pages_free_, self->sequences_,
                             self->cache_bytes_}) {
        g->Clear();
      }
      for (const PoolStats& p : pools) {
        self->pages_total_->Set({p.name, p.device}, static_cast<double>(p.pages_total));
        self->pages_used_->Set({p.name, p.device}, static_cast<double>(p.pages_used));
        self->pages_free_->Set({p.name, p.device}, static_cast<double>(p.pages_free));
        self->sequences_->Set({p.name}, static_cast<double>(p.sequences));
        self->cache_bytes_->Set({p.name, p.device}, static_cast<double>(p.cache_bytes));
      }
    }
    if (self->ipc_source_) self->ipc_regions_->Set({}, static_cast<double>(self->ipc_source_()));
  });
  return m;
}

void ServerMetrics::SetPoolSource(std::function<std::vector<PoolStats>()> source) { pool_source_ = std::move(source); }
void ServerMetrics::SetIpcRegionSource(std::function<int64_t()> source) { ipc_source_ = std::move(source); }

void ServerMetrics::RpcStarted(const std::string& service, const std::string& method) {
  in_flight_->Add({service, method}, 1);
}

void ServerMetrics::RpcFinished(const std::string& service, const std::string& method, grpc::StatusCode code,
                                double seconds) {
  in_flight_->Add({service, method}, -1);
  const char* name = StatusCodeName(code);
  rpcs_->Add({service, method, name});
  if (code != grpc::StatusCode::OK) rpc_errors_->Add({service, method, name});
  rpc_latency_->Observe({service, method}, seconds);
}

void ServerMetrics::AppendFinished(const std::string& method, const std::string& pool, bool ok, uint64_t rows,
                                   uint64_t bytes, double seconds) {
  append_latency_->Observe({method}, seconds);
  if (!ok) return;
  const std::string& p = pool.empty() ? default_pool_ : pool;
  rows_->Add({p, method}, static_cast<double>(rows));
  bytes_->Add({p, method}, static_cast<double>(bytes));
}

void ServerMetrics::KernelRan(const std::string& pool, const std::string& device, double seconds) {
  kernel_seconds_->Add({pool, device}, seconds);
  kernel_calls_->Add({pool, device});
  kernel_latency_->Observe({pool, device}, seconds);
}

void ServerMetrics::AuthFailed(const std::string& reason) { auth_failures_->Add({reason}); }

void ServerMetrics::SetDraining(bool draining) { draining_->Set({}, draining ? 1 : 0); }

}  // namespace mlakv::server
