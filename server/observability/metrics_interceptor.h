// MetricsInterceptorFactory: a gRPC server interceptor that records every RPC
// in ServerMetrics without any code in the service: count by service, method
// and status code, latency, in-flight. What appends wrote (rows, bytes, by
// pool) is reported by the service itself (KvCacheService::Options::on_append).
// It passes the names as the call carries them; ServerMetrics maps every one
// it does not know (a method no service registers) to "unknown".
// Register with ServerBuilder::experimental().SetInterceptorCreators.
// Calls refused by the transport or the auth processor never reach it (see
// mlakv_auth_failures_total for the latter).
#pragma once

#include "grpcpp/support/server_interceptor.h"
#include "server/observability/server_metrics.h"

namespace mlakv::server {

class MetricsInterceptorFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit MetricsInterceptorFactory(ServerMetrics* metrics) : metrics_(metrics) {}  // not owned; outlives the server
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override;

 private:
  ServerMetrics* metrics_;
};

}  // namespace mlakv::server
