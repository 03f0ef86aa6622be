// QueueThreads: the threads that serve a grpc::Server's calls on the
// completion-queue API.
//
// Why one queue and several threads (docs/server.md "Threads"): gRPC 1.51 on
// Linux polls every socket of the process through one epoll set, and the
// thread that polls reads the request off the socket. A completion for a
// queue whose own thread is the one polling is taken by that thread at once;
// one for another queue (or for the callback API's threads, or the
// synchronous API's) is handed over with a condition-variable wake-up,
// ~20-50 us a call on the GPU host (docs/performance.md "The callback API's
// threads"). With every thread on one queue, whichever thread reads a
// request also runs its handler: no hand-over, and the others stay free to
// poll while it works.
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

  // The default for a server: one thread per four cores, 2 to 8. One thread
  // answers a lone client fastest; more keep calls flowing while some run
  // long handlers inline (an AppendBatch of a decode step, ~0.3 ms) and
  // share the socket reads of many connections.
  static int DefaultThreads();

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

 private:
  void Serve();
  void ServePolled();

  const std::unique_ptr<grpc::ServerCompletionQueue> queue_;
  const int threads_;
  const std::string name_;
  const absl::Duration poll_period_;
  std::vector<std::thread> workers_;
  mutable absl::Mutex mu_;
  int alive_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<bool> shut_down_{false};
};

}  // namespace mlakv::server::cq
