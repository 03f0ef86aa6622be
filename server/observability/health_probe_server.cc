#include "server/observability/health_probe_server.h"

#include <grpcpp/ext/health_check_service_server_builder_option.h>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "server/observability/reflection_option.h"

namespace mlakv::server {

absl::StatusOr<std::unique_ptr<HealthProbeServer>> HealthProbeServer::Create(const std::string& listen) {
  auto health = std::make_unique<ProbeHealthService>();
  grpc::ServerBuilder builder;
  // grpc.health.v1.Health and nothing else: no reflection (its plugin is
  // registered process-wide, ReflectionOption drops it), no default health
  // service (this one replaces it).
  builder.SetOption(std::make_unique<ReflectionOption>(/*serve=*/false));
  builder.SetOption(std::make_unique<grpc::HealthCheckServiceServerBuilderOption>(nullptr));
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a port in use is an error (kv_cache_server.cc)
  builder.RegisterService(health.get());
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("--health_listen ", listen, ": cannot listen there"));
  }
  return std::unique_ptr<HealthProbeServer>(new HealthProbeServer(std::move(health), std::move(server), port));
}

HealthProbeServer::~HealthProbeServer() { Shutdown(); }

void HealthProbeServer::SetServing(bool serving) {
  if (!shut_down_) health_->SetServing(serving);
}

void HealthProbeServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  health_->SetServing(false);
  server_->Shutdown(std::chrono::system_clock::now());  // cancels open Watch streams
  server_->Wait();
}

}  // namespace mlakv::server
