#include "server/observability/health_probe_server.h"

#include <grpcpp/ext/health_check_service_server_builder_option.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>

#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"

namespace mlakv::server {
namespace {

// Takes every plugin off the builder: a library in the process can register
// one for every ServerBuilder at its static initialization (as
// libgrpc++_reflection does, with a synchronous-API reflection service), and
// this port serves the health service and nothing else.
class NoPluginsOption final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override { plugins->clear(); }
};

}  // namespace

absl::StatusOr<std::unique_ptr<HealthProbeServer>> HealthProbeServer::Create(const std::string& listen) {
  auto health = std::make_unique<cq::HealthService>(std::vector<std::string>{v1::KvCache::service_full_name()});
  grpc::ServerBuilder builder;
  // grpc.health.v1.Health and nothing else: no plugin's service, no default
  // health service (this one replaces it; gRPC's is a callback service).
  builder.SetOption(std::make_unique<NoPluginsOption>());
  builder.SetOption(std::make_unique<grpc::HealthCheckServiceServerBuilderOption>(nullptr));
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a port in use is an error (kv_cache_server.cc)
  builder.RegisterService(health->service());
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  std::unique_ptr<grpc::ServerCompletionQueue> queue = builder.AddCompletionQueue();
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  auto threads = std::make_unique<cq::QueueThreads>(std::move(queue), 1, "health-probe", kPollPeriod);
  if (server == nullptr || port == 0) {
    if (server != nullptr) server->Shutdown(std::chrono::system_clock::now());
    threads->Shutdown();  // never started: drains the queue here
    return absl::UnavailableError(absl::StrCat("--health_listen ", listen, ": cannot listen there"));
  }
  threads->Start();
  health->Serve(threads.get());
  return std::unique_ptr<HealthProbeServer>(
      new HealthProbeServer(std::move(health), std::move(threads), std::move(server), port));
}

HealthProbeServer::~HealthProbeServer() { Shutdown(); }

void HealthProbeServer::SetServing(bool serving) { health_->SetServing(serving); }

void HealthProbeServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  health_->Shutdown();  // NOT_SERVING, and SetServing(true) ignored from now on
  server_->Shutdown(std::chrono::system_clock::now());  // cancels open Watch streams
  threads_->Shutdown();  // every call object gone, the queue drained, the thread joined
}

}  // namespace mlakv::server
