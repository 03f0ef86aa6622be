// RpcMethodSet: the (service, method) pairs that may appear as label values
// of the per-RPC metrics.
//
// The method of a call is whatever path the client sent ("/a.B/C"); gRPC runs
// the interceptor even for paths no service serves (they end UNIMPLEMENTED),
// so using the path as a label let 20,000 calls with random names grow
// /metrics to 80 MB. Only the methods the server registers are labels of
// their own; every other path counts as service="unknown", method="unknown".
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"

namespace mlakv::server {

class RpcMethodSet {
 public:
  // Label value of a service or method outside the set.
  static constexpr absl::string_view kUnknown = "unknown";

  // What mlakv-server registers (kv_cache_server.cc): every method of
  // mlakv.v1.KvCache, read from its protobuf service descriptor (so a method
  // added to kv_cache.proto is labelled without touching this file), plus
  // grpc.health.v1.Health and grpc.reflection.v1alpha.ServerReflection.
  static RpcMethodSet Served();

  // `methods`: (service full name, method name) pairs.
  explicit RpcMethodSet(const std::vector<std::pair<std::string, std::string>>& methods);

  bool Contains(absl::string_view service, absl::string_view method) const;
  // Every pair, sorted (tests, docs).
  std::vector<std::pair<std::string, std::string>> List() const;

 private:
  absl::flat_hash_map<std::string, absl::flat_hash_set<std::string>> methods_;  // service -> methods
};

}  // namespace mlakv::server
