// MetricsInterceptorFactory: a gRPC server interceptor that records RPCs in
// ServerMetrics: count by service, method and status code, latency,
// in-flight. The KvCache service records its synchronous methods itself
// (KvCacheService::RpcScope: same families, same labels) and they are
// skipped here, because a call with an interceptor pays gRPC's interception
// machinery (~15-20 us on the GPU host); the streams, the region
// registrations, health and reflection go through it. What appends wrote (rows, bytes, by
// pool) is reported by the service itself (KvCacheService::Options::on_append).
// It passes the names as the call carries them; ServerMetrics maps every one
// it does not know (a method no service registers) to "unknown".
// Register with ServerBuilder::experimental().SetInterceptorCreators.
// Calls refused by the transport or the auth processor never reach it (see
// mlakv_auth_failures_total for the latter).
#pragma once

#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"

#include "grpcpp/support/server_interceptor.h"
#include "server/observability/server_metrics.h"

namespace mlakv::server {

class MetricsInterceptorFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // `metrics` not owned, outlives the server. Calls whose path is in
  // `recorded_elsewhere` get no interceptor (the service records their
  // metrics itself, and gRPC skips its interception machinery for a call
  // without interceptors).
  explicit MetricsInterceptorFactory(ServerMetrics* metrics, std::vector<std::string> recorded_elsewhere = {})
      : metrics_(metrics), recorded_elsewhere_(recorded_elsewhere.begin(), recorded_elsewhere.end()) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override;

 private:
  ServerMetrics* metrics_;
  const absl::flat_hash_set<std::string> recorded_elsewhere_;
};

}  // namespace mlakv::server
