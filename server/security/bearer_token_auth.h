// BearerTokenAuthProcessor: requires `authorization: Bearer <token>` on every
// call except those whose method starts with an exempt prefix (by default the
// health service, so that probes need no secret). A missing header, another
// scheme or a wrong token fails the call with UNAUTHENTICATED before it
// reaches any service; the token comparison takes the same time wherever the
// first difference is.
//
// gRPC runs an AuthMetadataProcessor only on secure ports, so the token needs
// TLS (server_credentials.h enforces that): a bearer token sent in plaintext
// is readable on the path.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace mlakv::server {

class BearerTokenAuthProcessor : public grpc::AuthMetadataProcessor {
 public:
  struct Options {
    std::string token;  // the expected token, non-empty
    // Methods ("/package.Service/Method") starting with one of these pass
    // without a token.
    std::vector<std::string> exempt_prefixes = {"/grpc.health.v1.Health/"};
    // Called with "missing" or "invalid" for each refused call (metrics).
    std::function<void(const std::string& reason)> on_failure;
  };

  explicit BearerTokenAuthProcessor(Options options) : options_(std::move(options)) {}

  // Runs inline on gRPC's thread: the check is a few comparisons.
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata, OutputMetadata* response_metadata) override;

 private:
  const Options options_;
};

// Reads a token file: the first line without surrounding whitespace. Errors
// name the file: unreadable, empty, or a token with inner whitespace or
// control characters (not valid in a header).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// Compares a and b in time that depends only on their lengths.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

}  // namespace mlakv::server
