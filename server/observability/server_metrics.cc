#include "server/observability/server_metrics.h"

#include <array>
#include <atomic>
#include <exception>
#include <tuple>
#include <type_traits>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "server/observability/malloc_library.h"

namespace mlakv::server {
namespace {

// Latency buckets, seconds: 100 us .. 30 s.
const std::vector<double> kLatencyBuckets = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                             0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    10, 30};

const std::string kUnknown(RpcMethodSet::kUnknown);

// The children of one family, by label values. prometheus::Family<T>::Add
// builds a new T on every call and drops it when the child exists (for a
// histogram, 18 bucket counters per RPC), so children are found here and
// Add runs once per label set. Label values are bounded, so is this map.
template <typename T>
class Children {
 public:
  Children(prometheus::Family<T>& family, std::vector<std::string> label_names)
      : family_(family), label_names_(std::move(label_names)) {}

  // `values`: one per label name, in the same order.
  T& Get(std::vector<std::string> values) {
    absl::MutexLock lock(&mu_);
    auto it = children_.find(values);
    if (it != children_.end()) return *it->second;
    prometheus::Labels labels;
    for (size_t i = 0; i < label_names_.size(); ++i) labels[label_names_[i]] = values[i];
    T* child = nullptr;
    if constexpr (std::is_same_v<T, prometheus::Histogram>) {
      child = &family_.Add(labels, kLatencyBuckets);
    } else {
      child = &family_.Add(labels);
    }
    children_.emplace(std::move(values), child);
    return *child;
  }

 private:
  prometheus::Family<T>& family_;
  const std::vector<std::string> label_names_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::vector<std::string>, T*> children_ ABSL_GUARDED_BY(mu_);
};

using Counters = Children<prometheus::Counter>;
using Gauges = Children<prometheus::Gauge>;
using Histograms = Children<prometheus::Histogram>;

}  // namespace

struct ServerMetrics::Families {
  // The families live in the registry; the Children below point into it.
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();

  template <typename T>
  static prometheus::Family<T>& Build(prometheus::detail::Builder<T> builder, prometheus::Registry& r,
                                      const std::string& name, const std::string& help) {
    return builder.Name(name).Help(help).Register(r);
  }

  prometheus::Family<prometheus::Gauge>& build_info =
      Build(prometheus::BuildGauge(), *registry, "mlakv_build_info",
            "mlakv-server version and the library its malloc comes from (always 1).");
  Counters rpcs{Build(prometheus::BuildCounter(), *registry, "mlakv_rpcs_total",
                      "RPCs finished, by service, method and status code."),
                {"service", "method", "code"}};
  Counters rpc_errors{Build(prometheus::BuildCounter(), *registry, "mlakv_rpc_errors_total",
                            "RPCs finished with a status code other than OK."),
                      {"service", "method", "code"}};
  Histograms rpc_latency{Build(prometheus::BuildHistogram(), *registry, "mlakv_rpc_latency_seconds",
                               "RPC time from receipt to status, seconds."),
                         {"service", "method"}};
  Gauges in_flight{
      Build(prometheus::BuildGauge(), *registry, "mlakv_rpcs_in_flight", "RPCs started and not finished."),
      {"service", "method"}};
  Counters rows{Build(prometheus::BuildCounter(), *registry, "mlakv_appended_rows_total",
                      "Rows appended (one row = one token of one layer) by successful Append and AppendBatch "
                      "calls."),
                {"pool", "method"}};
  Counters bytes{Build(prometheus::BuildCounter(), *registry, "mlakv_appended_bytes_total",
                       "Input bytes (ckv + kpe, fp16/bf16) of successful appends."),
                 {"pool", "method"}};
  Histograms append_latency{Build(prometheus::BuildHistogram(), *registry, "mlakv_append_latency_seconds",
                                  "Append and AppendBatch call time, first message to status, any outcome."),
                            {"method"}};
  Counters kernel_seconds{Build(prometheus::BuildCounter(), *registry, "mlakv_kernel_seconds_total",
                                "Seconds spent in the backend's quantize-append (CUDA: launch to stream "
                                "synchronized, staging copies included)."),
                          {"pool", "device"}};
  Counters kernel_calls{
      Build(prometheus::BuildCounter(), *registry, "mlakv_kernel_calls_total", "Backend quantize-append calls."),
      {"pool", "device"}};
  Histograms kernel_latency{Build(prometheus::BuildHistogram(), *registry, "mlakv_kernel_latency_seconds",
                                  "Backend quantize-append call time, seconds."),
                            {"pool", "device"}};
  Counters auth_failures{Build(prometheus::BuildCounter(), *registry, "mlakv_auth_failures_total",
                               "Calls refused with UNAUTHENTICATED before reaching the service (reason: missing "
                               "or wrong bearer token)."),
                         {"reason"}};
  prometheus::Gauge& draining =
      Build(prometheus::BuildGauge(), *registry, "mlakv_draining", "1 while the server drains after SIGTERM.").Add({});
};

std::string StatusCodeName(grpc::StatusCode code) {
  // gRPC's codes are absl's canonical codes, number for number.
  const int n = static_cast<int>(code);
  if (n < 0 || n > static_cast<int>(grpc::StatusCode::UNAUTHENTICATED)) return "UNKNOWN";
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(n));
}

ServerMetrics::ServerMetrics() = default;
ServerMetrics::~ServerMetrics() = default;

absl::StatusOr<std::unique_ptr<ServerMetrics>> ServerMetrics::Create(const std::string& version) {
  std::unique_ptr<ServerMetrics> m(new ServerMetrics());
  m->scrape_time_ = std::make_shared<ScrapeTimeCollector>();
  // prometheus-cpp reports a bad or duplicate family name by throwing;
  // nothing past this point throws for names fixed here.
  try {
    m->families_ = std::make_unique<Families>();
    m->families_->build_info.Add({{"version", version}, {"allocator", MallocLibrary()}}).Set(1);
    m->families_->draining.Set(0);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("metrics: prometheus-cpp refused a family: ", e.what()));
  }
  return m;
}

std::vector<std::weak_ptr<prometheus::Collectable>> ServerMetrics::collectables() const {
  return {families_->registry, scrape_time_};
}

std::string ServerMetrics::Render() const {
  std::vector<prometheus::MetricFamily> families = families_->registry->Collect();
  for (prometheus::MetricFamily& f : scrape_time_->Collect()) families.push_back(std::move(f));
  return prometheus::TextSerializer().Serialize(families);
}

void ServerMetrics::SetPoolSource(std::function<std::vector<PoolSnapshot>()> source) {
  scrape_time_->SetPoolSource(std::move(source));
}

void ServerMetrics::SetIpcRegionSource(std::function<int64_t()> source) {
  scrape_time_->SetIpcRegionSource(std::move(source));
}

void ServerMetrics::SetTransportSource(std::function<SerialExecutor::Load()> source) {
  scrape_time_->SetTransportSource(std::move(source));
}

void ServerMetrics::SetEventsSource(std::function<ScrapeTimeCollector::EventsLoad()> source) {
  scrape_time_->SetEventsSource(std::move(source));
}

void ServerMetrics::SetDefaultPool(std::string name) {
  absl::MutexLock lock(&pools_mu_);
  default_pool_ = std::move(name);
}

std::string ServerMetrics::default_pool() const {
  absl::MutexLock lock(&pools_mu_);
  return default_pool_;
}

void ServerMetrics::SetPools(const std::vector<std::string>& names) {
  absl::MutexLock lock(&pools_mu_);
  pools_ = absl::flat_hash_set<std::string>(names.begin(), names.end());
}

std::pair<std::string, std::string> ServerMetrics::RpcLabels(const std::string& service,
                                                             const std::string& method) const {
  if (methods_.Contains(service, method)) return {service, method};
  return {kUnknown, kUnknown};
}

std::string ServerMetrics::PoolLabel(const std::string& pool) const {
  absl::MutexLock lock(&pools_mu_);
  const std::string& p = pool.empty() ? default_pool_ : pool;
  return pools_.contains(p) ? p : kUnknown;
}

// One (service, method) label pair's children; the per-code counters are
// added on first use (a family child per code ever seen, as before).
struct ServerMetrics::RpcChildren {
  static constexpr int kCodes = static_cast<int>(grpc::StatusCode::UNAUTHENTICATED) + 2;  // + UNKNOWN's slot
  std::string service, method;  // the label values
  prometheus::Gauge* in_flight = nullptr;
  prometheus::Histogram* latency = nullptr;
  std::array<std::atomic<prometheus::Counter*>, kCodes> rpcs{}, errors{};
};

ServerMetrics::RpcChildren& ServerMetrics::ChildrenOfLabels(const std::string& service, const std::string& method) {
  auto made = std::make_unique<RpcChildren>();
  made->service = service;
  made->method = method;
  made->in_flight = &families_->in_flight.Get({service, method});
  made->latency = &families_->rpc_latency.Get({service, method});
  RpcChildren& out = *made;
  if (service == kUnknown) {
    unknown_children_ = std::move(made);
  } else {
    children_.emplace(absl::StrCat("/", service, "/", method), std::move(made));
  }
  return out;
}

ServerMetrics::RpcChildren& ServerMetrics::ChildrenOf(absl::string_view path) {
  {
    absl::ReaderMutexLock lock(&children_mu_);
    if (auto it = children_.find(path); it != children_.end()) return *it->second;
  }
  // "/package.Service/Method"
  std::string service = kUnknown, method = kUnknown;
  const size_t slash = path.rfind('/');
  if (path.size() > 1 && path[0] == '/' && slash != absl::string_view::npos && slash > 1) {
    std::tie(service, method) = RpcLabels(std::string(path.substr(1, slash - 1)), std::string(path.substr(slash + 1)));
  }
  absl::MutexLock lock(&children_mu_);
  if (service == kUnknown) {  // every other path shares one entry: the map stays bounded
    return unknown_children_ ? *unknown_children_ : ChildrenOfLabels(kUnknown, kUnknown);
  }
  if (auto it = children_.find(path); it != children_.end()) return *it->second;
  return ChildrenOfLabels(service, method);
}

void ServerMetrics::RpcStarted(RpcChildren& c) { c.in_flight->Increment(); }

void ServerMetrics::RpcFinished(RpcChildren& c, grpc::StatusCode code, double seconds) {
  c.in_flight->Decrement();
  const int n = static_cast<int>(code);
  const int slot = n >= 0 && n < RpcChildren::kCodes - 1 ? n : RpcChildren::kCodes - 1;
  auto counter = [&](std::atomic<prometheus::Counter*>& cached, Counters& family) -> prometheus::Counter& {
    prometheus::Counter* p = cached.load(std::memory_order_acquire);
    if (p == nullptr) {
      p = &family.Get({c.service, c.method, StatusCodeName(code)});  // the same child whoever races here
      cached.store(p, std::memory_order_release);
    }
    return *p;
  };
  counter(c.rpcs[slot], families_->rpcs).Increment();
  if (code != grpc::StatusCode::OK) counter(c.errors[slot], families_->rpc_errors).Increment();
  c.latency->Observe(seconds);
}

void ServerMetrics::RpcStarted(const std::string& service, const std::string& method) {
  RpcStarted(ChildrenOf(absl::StrCat("/", service, "/", method)));
}

void ServerMetrics::RpcFinished(const std::string& service, const std::string& method, grpc::StatusCode code,
                                double seconds) {
  RpcFinished(ChildrenOf(absl::StrCat("/", service, "/", method)), code, seconds);
}

void ServerMetrics::AppendFinished(const std::string& method, const std::string& pool, bool ok, uint64_t rows,
                                   uint64_t bytes, double seconds) {
  // The service calls this (KvCacheService::Options::on_append) for KvCache
  // Append / AppendBatch; the check keeps the label bounded for any other
  // caller too.
  const std::string m = methods_.Contains(v1::KvCache::service_full_name(), method) ? method : kUnknown;
  Families& f = *families_;
  f.append_latency.Get({m}).Observe(seconds);
  if (!ok) return;
  const std::string p = PoolLabel(pool);
  f.rows.Get({p, m}).Increment(static_cast<double>(rows));
  f.bytes.Get({p, m}).Increment(static_cast<double>(bytes));
}

void ServerMetrics::KernelRan(const std::string& pool, const std::string& device, double seconds) {
  Families& f = *families_;
  f.kernel_seconds.Get({pool, device}).Increment(seconds);
  f.kernel_calls.Get({pool, device}).Increment();
  f.kernel_latency.Get({pool, device}).Observe(seconds);
}

void ServerMetrics::AuthFailed(const std::string& reason) { families_->auth_failures.Get({reason}).Increment(); }

void ServerMetrics::SetDraining(bool draining) { families_->draining.Set(draining ? 1 : 0); }

}  // namespace mlakv::server
