#include "server/observability/scrape_time_collector.h"

#include <utility>

#include "prometheus/client_metric.h"
#include "prometheus/metric_type.h"

namespace mlakv::server {
namespace {

prometheus::MetricFamily Family(std::string name, std::string help, prometheus::MetricType type) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

prometheus::MetricFamily GaugeFamily(std::string name, std::string help) {
  return Family(std::move(name), std::move(help), prometheus::MetricType::Gauge);
}

prometheus::MetricFamily CounterFamily(std::string name, std::string help) {
  return Family(std::move(name), std::move(help), prometheus::MetricType::Counter);
}

// A sample of the family's type (a gauge's or a counter's value).
void AddSample(prometheus::MetricFamily& f, std::vector<prometheus::ClientMetric::Label> labels, double value) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  if (f.type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
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

void ScrapeTimeCollector::SetTransportSource(std::function<SerialExecutor::Load()> source) {
  absl::MutexLock lock(&mu_);
  transport_source_ = std::move(source);
}

void ScrapeTimeCollector::SetEventsSource(std::function<EventsLoad()> source) {
  absl::MutexLock lock(&mu_);
  events_source_ = std::move(source);
}

namespace {

// The ZeroMQ publisher's work (docs/events.md "vLLM's format on ZeroMQ").
void AddZmqPublisherFamilies(const EventPublisherStats& zmq, std::vector<prometheus::MetricFamily>& out) {
  prometheus::MetricFamily batches =
      CounterFamily("mlakv_kv_events_zmq_batches_total", "KV event batches published on the ZeroMQ PUB socket.");
  AddSample(batches, {}, static_cast<double>(zmq.batches));
  prometheus::MetricFamily replays = CounterFamily(
      "mlakv_kv_events_zmq_replays_total",
      "ZeroMQ replay requests by how they ended: done (end marker sent), abandoned (the peer left or took nothing "
      "for 10 s), dropped (events.zmq_max_replays were in progress).");
  AddSample(replays, {{"result", "done"}}, static_cast<double>(zmq.replays_done));
  AddSample(replays, {{"result", "abandoned"}}, static_cast<double>(zmq.replays_abandoned));
  AddSample(replays, {{"result", "dropped"}}, static_cast<double>(zmq.replays_dropped));
  prometheus::MetricFamily active = GaugeFamily("mlakv_kv_events_zmq_replays", "ZeroMQ replays in progress.");
  AddSample(active, {}, static_cast<double>(zmq.replays_active));
  out.push_back(std::move(batches));
  out.push_back(std::move(replays));
  out.push_back(std::move(active));
}

}  // namespace

std::vector<prometheus::MetricFamily> ScrapeTimeCollector::Collect() const {
  std::vector<PoolSnapshot> pools;
  int64_t regions = 0;
  SerialExecutor::Load transport;
  EventsLoad events;
  {
    // Held while the sources run, so that SetPoolSource(nullptr) returns
    // only once no scrape is still inside the old source. Readers share it.
    absl::ReaderMutexLock lock(&mu_);
    if (pool_source_) pools = pool_source_();
    if (ipc_source_) regions = ipc_source_();
    if (transport_source_) transport = transport_source_();
    if (events_source_) events = events_source_();
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
  // Cache management (docs/server.md "Leases", "Eviction", "Shared pages"),
  // per pool: gauges of what is held now, counters since the start.
  struct PoolValue {
    const char* name;
    const char* help;
    bool counter;
    double (*get)(const PoolSnapshot&);
  };
  static constexpr PoolValue kPoolValues[] = {
      {"mlakv_pool_pages_shared", "Used pages with more than one reference (forks, page leases).", false,
       [](const PoolSnapshot& p) { return static_cast<double>(p.pages_shared); }},
      {"mlakv_pool_pages_indexed", "Pages indexed by block hash (MatchPrefix finds them).", false,
       [](const PoolSnapshot& p) { return static_cast<double>(p.pages_indexed); }},
      {"mlakv_pool_leases", "Leases alive (sequence and page leases).", false,
       [](const PoolSnapshot& p) { return static_cast<double>(p.leases); }},
      {"mlakv_pool_sequences_retained", "Freed sequences whose pages a lease still holds.", false,
       [](const PoolSnapshot& p) { return static_cast<double>(p.sequences_retained); }},
      {"mlakv_evictions_total", "Sequences evicted to make room.", true,
       [](const PoolSnapshot& p) { return static_cast<double>(p.counters.evictions); }},
      {"mlakv_evicted_pages_total", "Pages evicted sequences released.", true,
       [](const PoolSnapshot& p) { return static_cast<double>(p.counters.evicted_pages); }},
      {"mlakv_idle_freed_sequences_total", "Sequences freed by the idle TTL.", true,
       [](const PoolSnapshot& p) { return static_cast<double>(p.counters.idle_freed); }},
      {"mlakv_leases_acquired_total", "Leases taken.", true,
       [](const PoolSnapshot& p) { return static_cast<double>(p.counters.leases_acquired); }},
      {"mlakv_leases_released_total", "Leases their holder released.", true,
       [](const PoolSnapshot& p) { return static_cast<double>(p.counters.leases_released); }},
      {"mlakv_leases_expired_total", "Leases that expired unrenewed (released by the server).", true,
       [](const PoolSnapshot& p) { return static_cast<double>(p.counters.leases_expired); }},
      {"mlakv_forks_total", "Sequences created by ForkSequence.", true,
       [](const PoolSnapshot& p) { return static_cast<double>(p.counters.forks); }},
      {"mlakv_fork_shared_pages_total", "Pages forks share by reference.", true,
       [](const PoolSnapshot& p) { return static_cast<double>(p.counters.fork_pages_shared); }},
      {"mlakv_pages_copied_total", "Pages copied: partial last pages of forks and copy-on-write of shared pages.",
       true, [](const PoolSnapshot& p) { return static_cast<double>(p.counters.pages_copied); }},
      {"mlakv_prefix_queries_total", "Block-hash chains looked up (MatchPrefix, forks by hash).", true,
       [](const PoolSnapshot& p) { return static_cast<double>(p.counters.prefix_queries); }},
      {"mlakv_prefix_hit_pages_total", "Leading pages those lookups found.", true,
       [](const PoolSnapshot& p) { return static_cast<double>(p.counters.prefix_hit_pages); }},
      {"mlakv_pool_worker_busy_seconds_total",
       "Time the pool's worker spent on its tasks (appends, reads, restores); its rate is the worker's "
       "utilization, 1 when every call of the pool waits for it.",
       true, [](const PoolSnapshot& p) { return p.worker.busy_seconds; }},
      {"mlakv_pool_worker_tasks", "Tasks queued on or running on the pool's worker.", false,
       [](const PoolSnapshot& p) { return static_cast<double>(p.worker.pending); }},
  };
  std::vector<prometheus::MetricFamily> cache_families;
  for (const PoolValue& v : kPoolValues) {
    prometheus::MetricFamily f = v.counter ? CounterFamily(v.name, v.help) : GaugeFamily(v.name, v.help);
    for (const PoolSnapshot& p : pools) AddSample(f, {{"pool", p.name}}, v.get(p));
    cache_families.push_back(std::move(f));
  }
  prometheus::MetricFamily ipc =
      GaugeFamily("mlakv_ipc_regions", "Regions (host shared memory and CUDA IPC) registered by producers.");
  AddSample(ipc, {}, static_cast<double>(regions));
  prometheus::MetricFamily transport_busy = CounterFamily(
      "mlakv_transport_busy_seconds_total",
      "Time the Append streams' transport threads spent freeing staged messages, starting reads and finishing "
      "streams off the pools' workers; its rate over the number of threads is their utilization.");
  AddSample(transport_busy, {}, transport.busy_seconds);
  prometheus::MetricFamily transport_tasks =
      GaugeFamily("mlakv_transport_tasks", "Tasks queued on or running on the transport threads.");
  AddSample(transport_tasks, {}, static_cast<double>(transport.pending));
  prometheus::MetricFamily events_recorded =
      CounterFamily("mlakv_kv_events_recorded_total", "KV events recorded since the server started (docs/events.md).");
  AddSample(events_recorded, {}, static_cast<double>(events.log.recorded));
  prometheus::MetricFamily events_kept =
      GaugeFamily("mlakv_kv_events_kept", "KV events in the replay buffer (at most events.replay_capacity).");
  AddSample(events_kept, {}, static_cast<double>(events.log.kept));
  prometheus::MetricFamily events_bytes = GaugeFamily(
      "mlakv_kv_events_kept_bytes", "Memory the KV events in the replay buffer hold (at most events.replay_bytes).");
  AddSample(events_bytes, {}, static_cast<double>(events.log.kept_bytes));
  prometheus::MetricFamily watchers = GaugeFamily("mlakv_kv_events_watchers", "WatchEvents streams open.");
  AddSample(watchers, {}, static_cast<double>(events.watchers));
  std::vector<prometheus::MetricFamily> out;
  for (prometheus::MetricFamily* f : {&capacity, &used, &free, &sequences, &cache_bytes, &ipc, &transport_busy,
                                      &transport_tasks, &events_recorded, &events_kept, &events_bytes, &watchers}) {
    out.push_back(std::move(*f));
  }
  if (events.zmq) AddZmqPublisherFamilies(*events.zmq, out);
  for (prometheus::MetricFamily& f : cache_families) out.push_back(std::move(f));
  return out;
}

}  // namespace mlakv::server
