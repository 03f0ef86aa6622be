// StreamWatchdog: ends streams whose client has gone quiet.
//
// An Append stream holds its sequence exclusively and the pages it staged
// until it ends; a client that opens one and then sends nothing (a stall, a
// peer that vanished without a FIN) would hold them forever. Each Append
// reactor registers here; a thread ticks every period and calls every
// registered stream's OnWatchdogTick, which decides for itself whether it
// has been idle too long and, if so, hands its rollback to a worker (it
// must not block or finish the call inside the tick).
//
// Remove() waits for a tick in progress, so a stream that removed itself
// (in OnDone) is never ticked again: the reactor can then be deleted.
#pragma once

#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace mlakv::server {

class StreamWatchdog {
 public:
  class Watched {
   public:
    virtual ~Watched() = default;
    // Called on the watchdog thread; short and non-blocking.
    virtual void OnWatchdogTick(absl::Time now) = 0;
  };

  // `period`: time between ticks (> 0).
  explicit StreamWatchdog(absl::Duration period);
  ~StreamWatchdog();
  StreamWatchdog(const StreamWatchdog&) = delete;
  StreamWatchdog& operator=(const StreamWatchdog&) = delete;

  void Add(Watched* watched);
  void Remove(Watched* watched);
  size_t size() const;

 private:
  void Run();

  const absl::Duration period_;
  mutable absl::Mutex mu_;
  absl::flat_hash_set<Watched*> watched_ ABSL_GUARDED_BY(mu_);
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace mlakv::server
