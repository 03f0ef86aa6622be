#include "server/security/bearer_token_auth.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace mlakv::server {

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  // OpenSSL's constant-time compare, over SHA-256 digests so that neither
  // the content nor the length of the expected token shows in the time.
  unsigned char da[SHA256_DIGEST_LENGTH], db[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(a.data()), a.size(), da);
  SHA256(reinterpret_cast<const unsigned char*>(b.data()), b.size(), db);
  return CRYPTO_memcmp(da, db, sizeof(da)) == 0 && a.size() == b.size();
}

grpc::Status BearerTokenAuthProcessor::Process(const InputMetadata& auth_metadata, grpc::AuthContext* /*context*/,
                                               OutputMetadata* consumed_auth_metadata,
                                               OutputMetadata* /*response_metadata*/) {
  auto path_it = auth_metadata.find(":path");
  if (path_it != auth_metadata.end()) {
    std::string path(path_it->second.data(), path_it->second.size());
    for (const auto& prefix : options_.exempt_prefixes) {
      if (path.rfind(prefix, 0) == 0) return grpc::Status::OK;
    }
  }
  auto fail = [&](const char* reason, const char* message) {
    if (options_.on_failure) options_.on_failure(reason);
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, message);
  };
  auto it = auth_metadata.find("authorization");
  if (it == auth_metadata.end()) {
    return fail("missing", "this server requires a bearer token: send metadata \"authorization: Bearer <token>\"");
  }
  std::string value(it->second.data(), it->second.size());
  constexpr char kScheme[] = "bearer ";
  if (value.size() < sizeof(kScheme) - 1 || absl::AsciiStrToLower(value.substr(0, sizeof(kScheme) - 1)) != kScheme) {
    return fail("missing", "authorization metadata is not \"Bearer <token>\"");
  }
  std::string token = value.substr(sizeof(kScheme) - 1);
  if (!ConstantTimeEquals(token, options_.token)) return fail("invalid", "bearer token rejected");
  // The token has done its job; the service does not see it.
  consumed_auth_metadata->insert(std::make_pair(std::string("authorization"), value));
  return grpc::Status::OK;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--auth_token_file ", path, ": cannot open"));
  std::string line;
  std::getline(in, line);
  std::string token(absl::StripAsciiWhitespace(line));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("--auth_token_file ", path, ": empty token"));
  for (char c : token) {
    if (c <= 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("--auth_token_file ", path, ": the token has whitespace or control characters"));
    }
  }
  return token;
}

}  // namespace mlakv::server
