// HealthService: grpc.health.v1.Health (Check, Watch) on a QueueThreads.
//
// gRPC's default health service is a callback-API service, and one such
// service anywhere in the process starts the callback threads that poll
// beside the queue's own (cq/queue_threads.h); this one runs on the server's
// completion queue like every other call. The semantics are those of the
// default service with one status for the whole server:
//  * "" and every name given to the constructor share one status, SERVING
//    from the start, set by SetServing;
//  * Check of any other name is NOT_FOUND ("unknown service"); Watch of one
//    sends SERVICE_UNKNOWN once and stays open;
//  * Watch sends the current status, then each change (a status equal to
//    the last one sent is not sent again; changes made while a write is in
//    flight collapse into the latest), until the client cancels, a write
//    fails or the server's shutdown cancels it;
//  * after Shutdown() the status is NOT_SERVING for good.
//
//   HealthService health({"mlakv.v1.KvCache"});
//   builder.RegisterService(health.service());
//   ... BuildAndStart, QueueThreads::Start ...
//   health.Serve(&threads);
//
// The service outlives the QueueThreads' Shutdown (its calls point at it).
#pragma once

#include <grpcpp/grpcpp.h>

#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "server/cq/calls.h"
#include "server/cq/queue_threads.h"

namespace mlakv::server::cq {

class HealthService {
 public:
  // `services`: the names known besides "" (e.g. {"mlakv.v1.KvCache"}).
  explicit HealthService(const std::vector<std::string>& services);
  ~HealthService();
  HealthService(const HealthService&) = delete;
  HealthService& operator=(const HealthService&) = delete;

  // To register with the ServerBuilder (its methods are all async).
  grpc::Service* service() { return &service_; }

  // Starts taking Check and Watch calls on `queue` (the server is built and
  // started; its threads may run already). Once.
  void Serve(QueueThreads* queue);

  // SERVING or NOT_SERVING from now on for "" and every known name; every
  // open Watch hears the change. Ignored after Shutdown().
  void SetServing(bool serving);
  // NOT_SERVING from now on, whatever SetServing says later.
  void Shutdown();

  // What Check answers for `service` now: SERVING, NOT_SERVING, or
  // SERVICE_UNKNOWN for a name it does not know.
  grpc::health::v1::HealthCheckResponse::ServingStatus Status(const std::string& service) const;

 private:
  using CheckCall = UnaryCall<grpc::health::v1::HealthCheckRequest, grpc::health::v1::HealthCheckResponse>;
  class WatchCall;

  void Check(CheckCall* call);
  grpc::health::v1::HealthCheckResponse::ServingStatus StatusLocked(const std::string& service) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Sets the status and tells every open watch.
  void Publish(bool serving) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  grpc::health::v1::Health::AsyncService service_;
  const absl::flat_hash_set<std::string> known_;
  CheckCall::Method check_;

  // Lock order: mu_, then a watch's own.
  mutable absl::Mutex mu_;
  bool serving_ ABSL_GUARDED_BY(mu_) = true;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  // The watches between their start and their OnDone: SetServing reaches
  // them through here, and none is touched once it left.
  absl::flat_hash_set<WatchCall*> watches_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mlakv::server::cq
