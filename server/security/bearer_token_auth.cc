#include "server/security/bearer_token_auth.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace mlakv::server {

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  // Walk the expected length whatever the input's, so the time says nothing
  // about where the first difference is.
  const size_t n = b.size();
  volatile unsigned char diff = static_cast<unsigned char>(a.size() != n);
  for (size_t i = 0; i < n; ++i) {
    unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    diff = diff | static_cast<unsigned char>(x ^ static_cast<unsigned char>(b[i]));
  }
  return diff == 0;
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
