// A real grpc::Server on 127.0.0.1:0 whose services all run on one
// QueueThreads (cq/queue_threads.h), for the tests of the services on it.
#pragma once

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "server/cq/queue_threads.h"

namespace mlakv::server::cq::testing {

class CqTestServer {
 public:
  // Builds and starts the server with `services` (completion-queue
  // services: their Serve comes after, on threads()) and starts `threads`
  // threads on its one queue, polled every `poll_period` if not zero.
  // `generic`: an asynchronous generic service for the methods no service
  // serves (cq/unknown_methods.h), if not null.
  CqTestServer(const std::vector<grpc::Service*>& services, int threads,
               absl::Duration poll_period = absl::ZeroDuration(), grpc::AsyncGenericService* generic = nullptr);
  ~CqTestServer();

  bool started() const { return server_ != nullptr; }
  QueueThreads* threads() { return threads_.get(); }
  // One channel for the test, over loopback TCP.
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }

  // The server's Shutdown with an immediate deadline (every open call is
  // cancelled), then the QueueThreads' (every call object deleted).
  // Idempotent; the destructor calls it.
  void Stop();

 private:
  std::unique_ptr<QueueThreads> threads_;  // its queue outlives server_
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  bool stopped_ = false;
};

}  // namespace mlakv::server::cq::testing
