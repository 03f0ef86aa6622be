// ScrapeTimeCollector: the gauges that mirror live server state — pool
// occupancy, the number of registered IPC regions, the KV events' replay
// buffer — built from their
// sources at every scrape rather than kept up to date by the code that
// changes them.
//
// A prometheus::Collectable: Collect() calls the sources and returns fresh
// families, so there is no stored copy that could go stale or race with a
// concurrent scrape (the endpoint serves several at once). Pool and device
// labels come from the server's configuration, never from a request.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "server/core/kv_events.h"
#include "server/core/pool.h"

namespace mlakv::server {

class ScrapeTimeCollector : public prometheus::Collectable {
 public:
  // The pool source returns each pool's Pool::Snapshot. Sources are called on the endpoint's threads, possibly several at once;
  // they must be thread-safe and must outlive every scrape (stop the
  // endpoint before what they read goes away). Unset: the pool families
  // have no samples and mlakv_ipc_regions is 0.
  void SetPoolSource(std::function<std::vector<PoolSnapshot>()> source);
  void SetIpcRegionSource(std::function<int64_t()> source);
  // The Append streams' transport threads, summed (KvCacheService::TransportLoad).
  void SetTransportSource(std::function<SerialExecutor::Load()> source);
  // The KV event log's replay buffer and the WatchEvents streams open.
  struct EventsLoad {
    EventLog::Stats log;
    int64_t watchers = 0;
    std::optional<EventPublisherStats> zmq{};  // the ZeroMQ publisher; absent: no --kv_events_endpoint
  };
  void SetEventsSource(std::function<EventsLoad()> source);

  // mlakv_pool_pages_capacity/_used/_free{pool,device},
  // mlakv_pool_sequences{pool}, mlakv_pool_cache_bytes{pool,device},
  // mlakv_ipc_regions, mlakv_transport_busy_seconds_total, mlakv_transport_tasks,
  // mlakv_kv_events_recorded_total, mlakv_kv_events_kept, mlakv_kv_events_kept_bytes,
  // mlakv_kv_events_watchers; with a ZeroMQ publisher mlakv_kv_events_zmq_batches_total,
  // mlakv_kv_events_zmq_replays_total{result}, mlakv_kv_events_zmq_replays.
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  mutable absl::Mutex mu_;
  std::function<std::vector<PoolSnapshot>()> pool_source_ ABSL_GUARDED_BY(mu_);
  std::function<int64_t()> ipc_source_ ABSL_GUARDED_BY(mu_);
  std::function<SerialExecutor::Load()> transport_source_ ABSL_GUARDED_BY(mu_);
  std::function<EventsLoad()> events_source_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mlakv::server
