// HealthProbeServer: a second, plaintext gRPC server (--health_listen) that
// serves grpc.health.v1.Health and nothing else.
//
// Kubelet's native gRPC probes speak neither TLS nor mutual TLS, so when the
// main port requires them the probes point here. Nothing but the health
// service is registered (cq::HealthService; no reflection, no KvCache), so
// no call can bypass TLS or the token through this port and the port
// describes nothing of the API. Its status follows the main server's through
// SetServing (NOT_SERVING from the start of a drain).
//
// The service runs on a completion queue of its own, served by one thread in
// QueueThreads' polled mode (cq/queue_threads.h): no callback-API service in
// the process (whose threads would poll beside the main server's queue), and
// no thread of this server blocked as one of the process's pollers either. A
// probe waits up to kPollPeriod longer for its answer; kubelet's timeout is
// a second.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "server/cq/health_service.h"
#include "server/cq/queue_threads.h"

namespace mlakv::server {

class HealthProbeServer {
 public:
  // How long the probe port's thread sleeps when its queue has nothing ready.
  static constexpr absl::Duration kPollPeriod = absl::Milliseconds(20);

  // Listens on `listen` (host:port; port 0 picks one, see port()).
  // Starts SERVING.
  static absl::StatusOr<std::unique_ptr<HealthProbeServer>> Create(const std::string& listen);
  ~HealthProbeServer();

  int port() const { return port_; }
  // Overall ("") and every service's status: SERVING or NOT_SERVING.
  // Ignored once Shutdown() began.
  void SetServing(bool serving);
  // NOT_SERVING, then stops the server (open Watch streams are cancelled)
  // and its thread. Idempotent; after this Check answers nothing.
  void Shutdown();

 private:
  HealthProbeServer(std::unique_ptr<cq::HealthService> health, std::unique_ptr<cq::QueueThreads> threads,
                    std::unique_ptr<grpc::Server> server, int port)
      : health_(std::move(health)), threads_(std::move(threads)), server_(std::move(server)), port_(port) {}
  std::unique_ptr<cq::HealthService> health_;  // outlives the calls on threads_
  std::unique_ptr<cq::QueueThreads> threads_;  // its queue outlives server_
  std::unique_ptr<grpc::Server> server_;
  const int port_;
  bool shut_down_ = false;
};

}  // namespace mlakv::server
