// UnknownMethods: the answer to a call of a method this server does not
// serve -- UNIMPLEMENTED, naming the path that came and what is served --
// given on the server's completion queue.
//
// Why not gRPC's own answer: a server with no generic service answers such
// calls with an internal request object (UnimplementedAsyncRequest) that
// gRPC 1.51 puts on every completion queue of the server. Its constructor
// arms the request before the object is fully built, so a queue thread can
// take the completion while the object is still its base class and return
// it to the application as a null tag (grpc/grpc#32356, fixed after 1.51):
// with several threads on the queue, a burst of unknown calls crashed the
// server. Registering an asynchronous generic service turns that object
// off; this class serves it.
//
//   UnknownMethods unknown("mlakv.v1.KvCache, grpc.health.v1.Health");
//   builder.RegisterAsyncGenericService(unknown.service());
//   ... BuildAndStart, QueueThreads::Start ...
//   unknown.Serve(&threads);
//
// The object outlives the QueueThreads' Shutdown (its calls point at it).
#pragma once

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <string>

#include "server/cq/queue_threads.h"

namespace mlakv::server::cq {

class UnknownMethods {
 public:
  // `served`: what the status message lists as served, e.g.
  // "mlakv.v1.KvCache, grpc.health.v1.Health".
  explicit UnknownMethods(std::string served) : served_(std::move(served)) {}
  UnknownMethods(const UnknownMethods&) = delete;
  UnknownMethods& operator=(const UnknownMethods&) = delete;

  grpc::AsyncGenericService* service() { return &service_; }
  // Arms the first call; after the server started, before any call can come.
  void Serve(QueueThreads* queue);

  // The status a call of `path` gets (exposed for tests).
  grpc::Status StatusFor(const std::string& path) const;

 private:
  class Call;

  const std::string served_;
  grpc::AsyncGenericService service_;
};

}  // namespace mlakv::server::cq
