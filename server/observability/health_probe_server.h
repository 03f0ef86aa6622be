// HealthProbeServer: a second, plaintext gRPC server (--health_listen) that
// serves grpc.health.v1.Health and nothing else.
//
// Kubelet's native gRPC probes speak neither TLS nor mutual TLS, so when the
// main port requires them the probes point here. Nothing but the health
// service is registered (ProbeHealthService; no reflection, no KvCache), so
// no call can bypass TLS or the token through this port and the port
// describes nothing of the API. Its status follows the main server's through
// SetServing (NOT_SERVING from the start of a drain).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/server.h"
#include "server/observability/probe_health_service.h"

namespace mlakv::server {

class HealthProbeServer {
 public:
  // Listens on `listen` (host:port; port 0 picks one, see port()).
  // Starts SERVING.
  static absl::StatusOr<std::unique_ptr<HealthProbeServer>> Create(const std::string& listen);
  ~HealthProbeServer();

  int port() const { return port_; }
  // Overall ("") and every service's status: SERVING or NOT_SERVING.
  void SetServing(bool serving);
  // Stops the server (idempotent); after this Check answers nothing.
  void Shutdown();

 private:
  HealthProbeServer(std::unique_ptr<ProbeHealthService> health, std::unique_ptr<grpc::Server> server, int port)
      : health_(std::move(health)), server_(std::move(server)), port_(port) {}
  std::unique_ptr<ProbeHealthService> health_;  // outlives server_
  std::unique_ptr<grpc::Server> server_;
  const int port_;
  bool shut_down_ = false;
};

}  // namespace mlakv::server
