// Server-side credentials from the security flags:
//   --tls_cert, --tls_key      PEM files: serve TLS (both or neither)
//   --tls_client_ca            PEM file: mutual TLS, client certificates are
//                              required and verified against this CA
//   --auth_token_file          a bearer token required on every RPC but
//                              grpc.health.v1.Health (needs TLS)
// With none of them: plaintext (InsecureServerCredentials).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"

namespace mlakv::server {

struct ServerSecurityOptions {
  std::string tls_cert_file;       // PEM certificate chain; empty: no TLS
  std::string tls_key_file;        // PEM private key of tls_cert_file
  std::string tls_client_ca_file;  // PEM CA bundle; non-empty: require client certificates
  std::string auth_token_file;     // file holding the bearer token; empty: no token
  // Called with "missing" / "invalid" for each call refused for its token.
  std::function<void(const std::string& reason)> on_auth_failure;
};

// A one-line description for the start-up log ("tls+mtls+token", "plaintext").
std::string DescribeSecurity(const ServerSecurityOptions& options);

// Errors (INVALID_ARGUMENT / NOT_FOUND, naming the flag and file): a cert
// without a key or the reverse, a client CA or token without TLS, unreadable
// or empty files, files that are not PEM.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> BuildServerCredentials(
    const ServerSecurityOptions& options);

}  // namespace mlakv::server
