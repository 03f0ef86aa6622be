// Which grpc::Server of the process serves reflection.
//
// Linking grpc++_reflection registers its plugin for every ServerBuilder of
// the process at static initialization, so without these options the
// plaintext health probe port would describe the whole API to anyone
// (docs/reliability.md). Each builder says what it wants:
//   builder.SetOption(std::make_unique<ReflectionOption>(true));   // the main port: exactly one
//   builder.SetOption(std::make_unique<ReflectionOption>(false));  // the health port: none
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/server_builder_option.h>

#include <memory>
#include <vector>

namespace mlakv::server {

class ReflectionOption : public grpc::ServerBuilderOption {
 public:
  explicit ReflectionOption(bool serve) : serve_(serve) {}
  void UpdateArguments(grpc::ChannelArguments*) override {}
  // Drops every reflection plugin the builder got, then adds one if serving.
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override;

 private:
  const bool serve_;
};

}  // namespace mlakv::server
