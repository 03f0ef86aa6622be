#include "client/server_set.h"

#include <netdb.h>
#include <sys/socket.h>
#include <arpa/inet.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/quote.h"

namespace mlakv {
namespace {

// host:port with a port in 1..65535 and a non-empty host.
absl::Status CheckHostPort(absl::string_view what, absl::string_view address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", Quote(address), " is not host:port"));
  }
  absl::string_view h = address.substr(0, colon);
  if (h.front() == '[') {
    if (h.back() != ']' || h.size() < 3) {
      return absl::InvalidArgumentError(absl::StrCat(what, " ", Quote(address), ": an IPv6 host is [address]"));
    }
  } else if (h.find(':') != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", Quote(address), ": write an IPv6 host in brackets, [address]:port"));
  }
  int p = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &p) || p < 1 ||
      p > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", Quote(address), ": the port must be 1..65535"));
  }
  if (host != nullptr) *host = std::string(h);
  if (port != nullptr) *port = p;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ServerSetSpec> ParseServerList(const std::string& list) {
  ServerSetSpec spec;
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    const std::string address(absl::StripAsciiWhitespace(part));
    if (address.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--servers ", Quote(list), " has an empty entry"));
    }
    if (absl::Status s = CheckHostPort("--servers entry", address, nullptr, nullptr); !s.ok()) return s;
    if (std::find(spec.servers.begin(), spec.servers.end(), address) != spec.servers.end()) {
      return absl::InvalidArgumentError(absl::StrCat("--servers names ", Quote(address), " twice"));
    }
    spec.servers.push_back(address);
  }
  if (spec.servers.empty()) return absl::InvalidArgumentError("--servers is empty");
  return spec;
}

absl::StatusOr<ServerSetSpec> ParseServiceTarget(const std::string& target) {
  constexpr absl::string_view kScheme = "dns:///";
  if (!absl::StartsWith(target, kScheme)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--service ", Quote(target), " is not dns:///NAME:PORT (e.g. dns:///mlakv.ns.svc:50051)"));
  }
  ServerSetSpec spec;
  std::string host;
  if (absl::Status s = CheckHostPort("--service", absl::string_view(target).substr(kScheme.size()), &host, &spec.port); !s.ok()) {
    return s;
  }
  spec.dns_name = host;
  return spec;
}

HostResolver SystemResolver() {
  return [](const std::string& name) -> absl::StatusOr<std::vector<std::string>> {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* result = nullptr;
    std::string host = name;
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &result);
    if (rc != 0) {
      return absl::UnavailableError(absl::StrCat("resolving ", Quote(name), ": ", gai_strerror(rc)));
    }
    std::vector<std::string> addresses;
    for (addrinfo* a = result; a != nullptr; a = a->ai_next) {
      char text[INET6_ADDRSTRLEN] = {};
      const void* src = a->ai_family == AF_INET6
                            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr)
                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr);
      if (inet_ntop(a->ai_family, src, text, sizeof(text)) == nullptr) continue;
      if (std::find(addresses.begin(), addresses.end(), text) == addresses.end()) addresses.emplace_back(text);
    }
    freeaddrinfo(result);
    return addresses;
  };
}

std::string JoinHostPort(const std::string& host, int port) {
  if (host.find(':') != std::string::npos && host.front() != '[') return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

}  // namespace mlakv
