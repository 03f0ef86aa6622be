// ProbeHealthService: grpc.health.v1.Health for the health probe port, with
// one status for the whole server ("" and mlakv.v1.KvCache; any other
// service name is NOT_FOUND for Check, SERVICE_UNKNOWN for Watch).
//
// The main port uses gRPC's default health service; the probe port cannot:
// a server whose only service is that default one has no method at build
// time and gRPC refuses to start it. This one is a callback service, so the
// probe port's grpc::Server has exactly it and nothing else.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace mlakv::server {

class ProbeHealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  ProbeHealthService() = default;
  ~ProbeHealthService() override;

  // SERVING or NOT_SERVING from now on; every Watch hears the change.
  void SetServing(bool serving);

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx, const grpc::health::v1::HealthCheckRequest* req,
                                  grpc::health::v1::HealthCheckResponse* resp) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* ctx, const grpc::health::v1::HealthCheckRequest* req) override;

 private:
  class WatchReactor;
  static bool Known(const std::string& service);
  grpc::health::v1::HealthCheckResponse::ServingStatus Status() const;

  std::atomic<bool> serving_{true};
  absl::Mutex mu_;
  absl::flat_hash_set<WatchReactor*> watchers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mlakv::server
