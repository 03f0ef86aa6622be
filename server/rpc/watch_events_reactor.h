// WatchEventsReactor: one WatchEvents stream (docs/events.md).
//
// Each watcher has its own thread that follows the EventLog by number:
// read what is there (waiting up to 200 ms for more), write it as one
// response, wait for the write to complete, repeat. The recording side
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

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "mlakv/v1/kv_cache.pb.h"
#include "server/core/kv_events.h"

namespace mlakv::server {

class WatchEventsReactor : public grpc::ServerWriteReactor<v1::WatchEventsResponse> {
 public:
  // `watchers` counts open streams (the caller incremented it; OnDone
  // decrements it); `log` and `watchers` outlive every stream (the service
  // drains them first). A `refused` status finishes the stream at once.
  WatchEventsReactor(const v1::WatchEventsRequest* req, EventLog* log, std::string server_id,
                     std::atomic<int>* watchers, absl::Status refused);

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

  // KvEvent as the wire has it.
  static void ToProto(const KvEvent& e, v1::KvEvent* out);

 private:
  struct State {
    absl::Mutex mu;
    bool writing ABSL_GUARDED_BY(mu) = false;
    bool write_failed ABSL_GUARDED_BY(mu) = false;
    bool cancelled ABSL_GUARDED_BY(mu) = false;
  };
  void Run(uint64_t from, uint32_t max_batch);

  EventLog* const log_;
  const std::string server_id_;
  std::atomic<int>* const watchers_;
  std::shared_ptr<State> state_ = std::make_shared<State>();
  v1::WatchEventsResponse response_;  // the write in flight (the thread's until OnWriteDone)
};

}  // namespace mlakv::server
