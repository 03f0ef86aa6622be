// SourceWaiter: waits, off a pool's worker, for the producers' CUDA events
// that rows by reference are read behind.
//
// An Append stream by reference holds its rows until the stream ends and
// writes them then (Pool::Stage's `deferred`). A layer-wise save ends its
// stream as soon as the forward pass is enqueued -- as vLLM's wait_for_save
// comes -- so the end usually arrives while the producer's GPU still computes
// the last layers, tens of ms before their events complete. Written at once,
// the pool's worker would block all that time (the backend waits for the
// events before it reads), and every other append to the pool with it: a
// decode step behind a prefill's save. The stream's end waits on the worker
// only while nothing else is queued there (Pool::WaitForSourcesHere) and
// hands the wait to the waiter as soon as something is; the worker is then
// free until the events have completed, and the commit is posted back to
// it.
//
// One thread per pool, started by the first wait. While anything waits it
// asks the backend (CacheBackend::EventsComplete) about every entry in a
// loop that only yields between rounds -- a core busy while a commit waits,
// as the worker's spinning synchronization was before (with a timed 20 us
// wait between rounds a 4k-token save's commit came 1.14 ms after its last
// layer on the H200, against 0.88-0.94 ms with the worker itself blocked on
// the event, docs/performance.md) -- and sleeps on a condition variable when
// nothing waits. Callbacks run on that thread, outside its lock, and must
// not block (they post to the worker).
#pragma once

#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backend/cache_backend.h"

namespace mlakv::server {

// The status of a wait whose deadline passed (SourceWaiter and Pool::WaitForSourcesHere).
absl::Status SourcesLateError();
// The status of a wait its caller gave up (WaitLimits::abandoned).
absl::Status SourcesAbandonedError();

// What ends a wait for producers' events before they complete.
struct WaitLimits {
  absl::Time deadline = absl::InfiniteFuture();  // then DEADLINE_EXCEEDED
  // Polled while the wait lasts (from whichever thread waits): true once the
  // caller gave up -- an Append whose client cancelled, or that the server
  // cancelled at shutdown -- and the wait ends with CANCELLED at once instead
  // of at the deadline. Empty: never. Must be cheap and must not block.
  std::function<bool()> abandoned{};

  bool Abandoned() const { return abandoned && abandoned(); }
};

class SourceWaiter {
 public:
  // OK once every event has completed; the query's error if one failed;
  // DEADLINE_EXCEEDED when the deadline passed first; CANCELLED when the
  // caller abandoned the wait or the waiter is destroyed first.
  using Done = absl::AnyInvocable<void(absl::Status) &&>;

  // `backend` outlives the waiter; `on_start` runs once on its thread (a
  // CUDA pool makes its device current there).
  SourceWaiter(CacheBackend* backend, absl::AnyInvocable<void() &&> on_start);
  // Calls every waiting entry's `done` with CANCELLED, then joins.
  ~SourceWaiter();
  SourceWaiter(const SourceWaiter&) = delete;
  SourceWaiter& operator=(const SourceWaiter&) = delete;

  // Calls `done` once, on the waiter's thread, when `events` (opaque event
  // handles the backend knows, as RowSource::wait_events carries them) have
  // all completed, or as above.
  void Wait(std::vector<const void*> events, WaitLimits limits, Done done);
  // Entries waiting (for tests and metrics).
  size_t waiting() const;

 private:
  struct Entry {
    std::vector<const void*> events;
    WaitLimits limits;
    Done done;
  };
  void Loop(absl::AnyInvocable<void() &&> on_start);

  CacheBackend* const backend_;
  mutable absl::Mutex mu_;
  absl::AnyInvocable<void() &&> on_start_ ABSL_GUARDED_BY(mu_);  // moved to the thread when it starts
  std::vector<Entry> incoming_ ABSL_GUARDED_BY(mu_);  // handed over to the thread's own list each round
  size_t waiting_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_ ABSL_GUARDED_BY(mu_);  // joined by the destructor (no Wait can start it then)
};

}  // namespace mlakv::server
