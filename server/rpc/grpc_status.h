// The one place where absl::Status becomes grpc::Status (the service edge).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace mlakv::server {

// Same code, same message: absl and gRPC share the canonical code numbers,
// so the code is a checked cast; anything outside them is UNKNOWN.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace mlakv::server
