#include "server/observability/scrape_time_collector.h"

#include <utility>

#include "prometheus/client_metric.h"
#include "prometheus/metric_type.h"

namespace mlakv::server {
namespace {

prometheus::MetricFamily GaugeFamily(std::string name, std::string help) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = prometheus::MetricType::Gauge;
  return f;
}

void AddSample(prometheus::MetricFamily& f, std::vector<prometheus::ClientMetric::Label> labels, double value) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = value;
  f.metric.push_back(std::move(m));
}

}  // namespace

void ScrapeTimeCollector::SetPoolSource(std::function<std::vector<PoolSnapshot>()> source) {
  absl::MutexLock lock(&mu_);
  pool_source_ = std::move(source);
}

void ScrapeTimeCollector::SetIpcRegionSource(std::function<int64_t()> source) {
  absl::MutexLock lock(&mu_);
  ipc_source_ = std::move(source);
}

std::vector<prometheus::MetricFamily> ScrapeTimeCollector::Collect() const {
  std::vector<PoolSnapshot> pools;
  int64_t regions = 0;
  {
    // Held while the sources run, so that SetPoolSource(nullptr) returns
    // only once no scrape is still inside the old source. Readers share it.
    absl::ReaderMutexLock lock(&mu_);
    if (pool_source_) pools = pool_source_();
    if (ipc_source_) regions = ipc_source_();
  }
  prometheus::MetricFamily capacity = GaugeFamily("mlakv_pool_pages_capacity", "Pages in the pool (used + free).");
  prometheus::MetricFamily used = GaugeFamily("mlakv_pool_pages_used", "Pages owned by sequences.");
  prometheus::MetricFamily free = GaugeFamily("mlakv_pool_pages_free", "Pages free.");
  prometheus::MetricFamily sequences = GaugeFamily("mlakv_pool_sequences", "Sequences alive in the pool.");
  prometheus::MetricFamily cache_bytes =
      GaugeFamily("mlakv_pool_cache_bytes", "Device bytes held by the pool's caches.");
  for (const PoolSnapshot& p : pools) {
    const std::vector<prometheus::ClientMetric::Label> pool_device = {{"device", p.device.ToString()},
                                                                      {"pool", p.name}};
    AddSample(capacity, pool_device, static_cast<double>(p.pages_total));
    AddSample(used, pool_device, static_cast<double>(p.pages_used));
    AddSample(free, pool_device, static_cast<double>(p.pages_free));
    AddSample(sequences, {{"pool", p.name}}, static_cast<double>(p.sequences));
    AddSample(cache_bytes, pool_device, static_cast<double>(p.cache_bytes));
  }
  prometheus::MetricFamily ipc =
      GaugeFamily("mlakv_ipc_regions", "Regions (host shared memory and CUDA IPC) registered by producers.");
  AddSample(ipc, {}, static_cast<double>(regions));
  std::vector<prometheus::MetricFamily> out;
  for (prometheus::MetricFamily* f : {&capacity, &used, &free, &sequences, &cache_bytes, &ipc}) {
    out.push_back(std::move(*f));
  }
  return out;
}

}  // namespace mlakv::server
