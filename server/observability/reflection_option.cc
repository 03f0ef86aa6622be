#include "server/observability/reflection_option.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>

#include <algorithm>

namespace mlakv::server {

void ReflectionOption::UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) {
  const std::string name = grpc::reflection::ProtoServerReflectionPlugin().name();
  plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                [&](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) { return p->name() == name; }),
                 plugins->end());
  if (serve_) plugins->push_back(std::make_unique<grpc::reflection::ProtoServerReflectionPlugin>());
}

}  // namespace mlakv::server
