#include "server/rpc/grpc_status.h"

#include <string>

namespace mlakv::server {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC number the canonical codes alike (0 OK .. 16
  // UNAUTHENTICATED); anything outside that range is UNKNOWN.
  const int code = static_cast<int>(status.code());
  const bool canonical = code >= static_cast<int>(grpc::StatusCode::OK) &&
                         code <= static_cast<int>(grpc::StatusCode::UNAUTHENTICATED);
  return grpc::Status(canonical ? static_cast<grpc::StatusCode>(code) : grpc::StatusCode::UNKNOWN,
                      std::string(status.message()));
}

}  // namespace mlakv::server
