// QueueThreads: the threads that serve a grpc::Server's calls on the
// completion-queue API.
//
// Why one queue, and one thread polling it at a time (docs/server.md
// "Threads"): gRPC 1.51 on Linux polls every socket of the process through
// one epoll set, and the thread that polls reads the request off the socket.
// A completion for a queue whose own thread is the one polling is taken by
// that thread at once; one for another queue (or for the callback API's
// threads, or the synchronous API's) is handed over with a condition-variable
// wake-up, ~20-50 us a call on the GPU host (docs/performance.md "The
// callback API's threads"). And when several threads wait in the same
// queue's Next(), epoll1 passes the polling to the next waiting thread each
// time the poller wakes up -- a signal per event, and a second wake-up when
// the completion lands -- before the first thread runs what it read: on the
// development VM a unary call took 66 us with one thread in Next() and 115
// us with two.
//
// So while the server is quiet the threads take turns: one holds the
// polling turn and waits in Next(); it runs what it takes and goes straight
// back to Next(), with no other thread woken. The others wait for the turn
// on a mutex of ours, not in gRPC. A step that will keep its thread busy for
// long (a pool's task run inline, the parse of a large Append message), or
// that may wait for something only another call brings, calls
// LetAnotherPoll() first: the turn passes to a waiting thread, which polls
// while this one works; when the work is done the thread waits for the turn
// again. What is short (a query, a read's bookkeeping) costs no wake-up at
// all; what is long costs one, which is small beside the work.
//
// But one poller is one thread reading every socket: with several clients
// streaming rows at once it caps the ingest at what one thread copies (on
// the H100 host, 8 connections moved 3.9 GB/s against 5.6 with gRPC's own
// threads). So the turns are for a quiet server only: while two or more
// calls are in progress (CallBusy .. CallIdle: unary calls and client
// streams from their request to their end; server streams such as
// WatchEvents do not count), every thread polls, and epoll1's passing the
// polling on at each event is what spreads the connections' reads over the
// threads. When the calls in progress fall back to one, the extra pollers
// leave Next() after their next event.
//
// Every call object of the queue (cq/calls.h) counts itself here from the
// moment it waits for a request until it is deleted. Shutdown() waits for
// that count to reach zero before it shuts the queue down, because starting
// an operation on a queue that is shut down aborts the process: a call
// finished late from a pool's worker, or a request armed after the last
// call matched, must still find the queue open.
//
// Polled mode (poll_period > 0), for a second server of the process (the
// health probe port): a thread blocked in Next() is a poller of the same
// process-wide epoll set, so a queue of its own with a thread waiting on it
// would read requests of the main server and hand them over to the main
// queue's threads -- the very hand-over one queue avoids. In polled mode
// each thread instead takes what is ready with AsyncNext and an immediate
// deadline, and sleeps poll_period when nothing is: the main queue's
// threads do the polling, and a call on that server waits up to poll_period
// more, which a probe does not notice.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace mlakv::server::cq {

// What a completion-queue tag stands for: one step of a call, run on a
// queue thread when the operation it was given to completes.
class Tag {
 public:
  // `ok`: the operation succeeded (gRPC's meaning for each operation).
  virtual void Proceed(bool ok) = 0;

 protected:
  ~Tag() = default;
};

class QueueThreads {
 public:
  // `queue` comes from the ServerBuilder (AddCompletionQueue) before the
  // server is built; Start() runs `threads` threads on it. `poll_period`:
  // zero, the threads block in Next(); else polled mode (above).
  QueueThreads(std::unique_ptr<grpc::ServerCompletionQueue> queue, int threads, std::string name,
               absl::Duration poll_period = absl::ZeroDuration());
  // Shutdown(), when it was not called.
  ~QueueThreads();
  QueueThreads(const QueueThreads&) = delete;
  QueueThreads& operator=(const QueueThreads&) = delete;

  // The default for a server: one thread per two cores, 2 to 16. Quiet, one
  // polls and the others wait for a turn (they cost nothing); busy, all of
  // them read the connections' sockets.
  static int DefaultThreads();

  // Called on a thread of a QueueThreads (blocking mode) before work that
  // keeps it for long: passes its polling turn to a waiting thread. Does
  // nothing on any other thread (a pool's worker, a test's thread) or when
  // the turn was already passed.
  static void LetAnotherPoll();

  void Start();
  // After grpc::Server::Shutdown returned (every call cancelled or ended):
  // waits until no call object of this queue is left (calls still finishing
  // on other threads finish through the queue's threads), then shuts the
  // queue down and joins the threads. Idempotent.
  void Shutdown();

  grpc::ServerCompletionQueue* queue() const { return queue_.get(); }
  int threads() const { return threads_; }

  // Call objects (cq/calls.h) count themselves alive: from when they ask for
  // a request until they are deleted.
  void CallCreated();
  void CallDeleted();
  int calls_alive() const;
  // And in progress, those that count toward the load: from their request's
  // match until they are deleted. Two or more: every thread polls.
  void CallBusy();
  void CallIdle();
  // How many threads may poll now (1, or threads() while busy), and how
  // many hold a polling turn (more than allowed just after the server went
  // quiet, until they take their next event).
  int pollers_allowed() const;
  int pollers() const { return pollers_.load(std::memory_order_relaxed); }
  int calls_in_progress() const { return busy_calls_.load(std::memory_order_relaxed); }

 private:
  void Serve();
  void ServePolled();
  void TakeTurn();
  void ReleaseTurn();
  // The turn holder keeps polling while this is false.
  bool TooManyPollers() const;
  static constexpr int kBusyCalls = 2;

  // The QueueThreads whose polling turn this thread holds, if any.
  static thread_local QueueThreads* turn_holder_;

  const std::unique_ptr<grpc::ServerCompletionQueue> queue_;
  const int threads_;
  const std::string name_;
  const absl::Duration poll_period_;
  std::vector<std::thread> workers_;
  // Written under turn_mu_ (so that a waiting TakeTurn re-checks its
  // condition on the unlock); read without it by the polling loop.
  absl::Mutex turn_mu_;
  std::atomic<int> pollers_{0};
  std::atomic<int> busy_calls_{0};
  mutable absl::Mutex mu_;
  int alive_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<bool> shut_down_{false};
};

}  // namespace mlakv::server::cq
