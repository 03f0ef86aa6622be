#include "server/security/server_credentials.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"
#include "server/security/bearer_token_auth.h"

namespace mlakv::server {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path, const char* marker) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--", flag, " ", path, ": cannot open"));
  std::ostringstream s;
  s << in.rdbuf();
  std::string pem = s.str();
  if (pem.find(marker) == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", path, ": no \"", marker, "\" block (not PEM?)"));
  }
  return pem;
}

}  // namespace

std::string DescribeSecurity(const ServerSecurityOptions& o) {
  if (o.tls_cert_file.empty()) return "plaintext";
  std::string d = "tls";
  if (!o.tls_client_ca_file.empty()) d += "+mtls";
  if (!o.auth_token_file.empty()) d += "+token";
  return d;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> BuildServerCredentials(const ServerSecurityOptions& o) {
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together: give both or neither");
  }
  const bool tls = !o.tls_cert_file.empty();
  if (!tls && !o.tls_client_ca_file.empty()) {
    return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key (mutual TLS is TLS)");
  }
  if (!tls && !o.auth_token_file.empty()) {
    return absl::InvalidArgumentError(
        "--auth_token_file needs --tls_cert and --tls_key: a bearer token sent in plaintext can be read on the way");
  }
  if (!tls) return grpc::InsecureServerCredentials();

  auto cert = ReadPem("tls_cert", o.tls_cert_file, "-----BEGIN CERTIFICATE-----");
  if (!cert.ok()) return cert.status();
  auto key = ReadPem("tls_key", o.tls_key_file, "PRIVATE KEY-----");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!o.tls_client_ca_file.empty()) {
    auto ca = ReadPem("tls_client_ca", o.tls_client_ca_file, "-----BEGIN CERTIFICATE-----");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::SslServerCredentials(ssl);
  if (!o.auth_token_file.empty()) {
    auto token = ReadTokenFile(o.auth_token_file);
    if (!token.ok()) return token.status();
    BearerTokenAuthProcessor::Options ao;
    ao.token = *token;
    ao.on_failure = o.on_auth_failure;
    creds->SetAuthMetadataProcessor(std::make_shared<BearerTokenAuthProcessor>(std::move(ao)));
  }
  return creds;
}

}  // namespace mlakv::server
