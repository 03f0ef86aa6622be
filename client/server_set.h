// Where a fleet's servers come from (FleetClient): a fixed list of
// host:port, or a DNS name that resolves to every server's address (a
// Kubernetes headless Service: one A/AAAA record per ready pod), given as
// gRPC's target syntax dns:///NAME:PORT and re-resolved periodically.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace mlakv {

struct ServerSetSpec {
  std::vector<std::string> servers{};  // host:port each (a fixed list)
  std::string dns_name{};              // or: the name to resolve...
  int port = 0;                        // ...and the port every address serves on
  bool uses_dns() const { return !dns_name.empty(); }
};

// "A,B,C" with each host:port ([v6]:port for IPv6 literals); duplicates are
// refused, so that one server cannot count twice in the placement.
absl::StatusOr<ServerSetSpec> ParseServerList(const std::string& list);
// "dns:///NAME:PORT" (the port is required: a Service's pods all serve on it).
absl::StatusOr<ServerSetSpec> ParseServiceTarget(const std::string& target);

// Resolves a name to the IP addresses (literals, no port) of all its
// records. Injectable so that tests exercise discovery without touching the
// machine's resolver.
using HostResolver = std::function<absl::StatusOr<std::vector<std::string>>(const std::string& name)>;
// getaddrinfo(3): A and AAAA records, deduplicated, in the resolver's order.
HostResolver SystemResolver();

// host:port, with [] around an IPv6 literal.
std::string JoinHostPort(const std::string& host, int port);

}  // namespace mlakv
