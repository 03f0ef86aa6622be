// WatchEventsReactor: one WatchEvents stream (docs/events.md), a
// server-streaming call on the server's completion queue (cq/calls.h).
//
// Each watcher has its own thread that follows the EventLog by number:
// read what is there (waiting up to 200 ms for more), write it as
// responses of at most ~1 MiB each, waiting for each write to complete,
// repeat. The recording side
// never waits for it: a watcher whose next event has left the log's ring has
// fallen behind and is finished with RESOURCE_EXHAUSTED. The thread calls
// Finish exactly once and never touches the reactor after it; what it shares
// with the reactions (write done, cancelled) lives in a State both hold, so
// OnDone may delete the reactor while the thread is still returning.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "mlakv/v1/kv_cache.pb.h"
#include "server/core/kv_events.h"
#include "server/cq/calls.h"

namespace mlakv::server {

class KvCacheService;

class WatchEventsReactor final : public cq::WriterCall<v1::WatchEventsRequest, v1::WatchEventsResponse> {
 public:
  // Serves WatchEvents on `queue` from now on. Each stream is counted in
  // the service's watchers() from its start to its end; the service and its
  // event log outlive every stream (the server drains them first).
  static void Serve(KvCacheService* service, cq::QueueThreads* queue) {
    Arm(new WatchEventsReactor(service, queue));
  }

  // KvEvent as the wire has it.
  static void ToProto(const KvEvent& e, v1::KvEvent* out);

 private:
  WatchEventsReactor(KvCacheService* service, cq::QueueThreads* queue) : WriterCall(queue), service_(service) {}

  void Request(void* tag) override;
  Call* NextCall() override { return new WatchEventsReactor(service_, queue_); }
  void OnStart() override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

  struct State {
    absl::Mutex mu;
    bool writing ABSL_GUARDED_BY(mu) = false;
    bool write_failed ABSL_GUARDED_BY(mu) = false;
    bool cancelled ABSL_GUARDED_BY(mu) = false;
  };
  void Run(uint64_t from, uint32_t max_batch);
  // Fills response_ with events[first..] up to its byte bound (at least one
  // event); returns the index after the last one it holds.
  size_t FillResponse(const std::vector<KvEvent>& events, size_t first);

  KvCacheService* const service_;
  EventLog* log_ = nullptr;  // the service's (set by OnStart)
  std::shared_ptr<State> state_ = std::make_shared<State>();
  v1::WatchEventsResponse response_;  // the write in flight (the thread's until OnWriteDone)
};

}  // namespace mlakv::server
