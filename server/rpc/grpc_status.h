// The one place where absl::Status becomes grpc::Status (the service edge).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace mlakv::server {

// Same code, same message. absl and gRPC share the canonical code numbers;
// the switch keeps the mapping explicit and maps anything unknown to UNKNOWN.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace mlakv::server
