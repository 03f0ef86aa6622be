#include "server/health_probe_server.h"

#include "absl/strings/str_cat.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace mlakv::server {

absl::StatusOr<std::unique_ptr<HealthProbeServer>> HealthProbeServer::Create(const std::string& listen) {
  // The default health service is switched on process-wide; this server
  // registers no other service, so it serves only grpc.health.v1.Health.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a port in use is an error (kv_cache_server.cc)
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("--health_listen ", listen, ": cannot listen there"));
  }
  if (server->GetHealthCheckService() == nullptr) {
    return absl::InternalError("health probe server: no health service");
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  return std::unique_ptr<HealthProbeServer>(new HealthProbeServer(std::move(server), port));
}

HealthProbeServer::~HealthProbeServer() { Shutdown(); }

void HealthProbeServer::SetServing(bool serving) {
  if (!shut_down_) server_->GetHealthCheckService()->SetServingStatus(serving);
}

void HealthProbeServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  server_->GetHealthCheckService()->Shutdown();
  server_->Shutdown(std::chrono::system_clock::now());
  server_->Wait();
}

}  // namespace mlakv::server
