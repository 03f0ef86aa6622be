#include "server/observability/metrics_interceptor.h"

#include <chrono>
#include <string>

namespace mlakv::server {
namespace {

using grpc::experimental::InterceptionHookPoints;

// Per-RPC metrics only: the interceptor never looks into messages (Append is
// a raw ByteBuffer method, and the service itself reports what an append
// wrote, through KvCacheService::Options::on_append).
class MetricsInterceptor : public grpc::experimental::Interceptor {
 public:
  MetricsInterceptor(grpc::experimental::ServerRpcInfo* info, ServerMetrics* metrics)
      : metrics_(metrics),
        children_(metrics->ChildrenOf(info->method() ? info->method() : "")),
        start_(std::chrono::steady_clock::now()) {
    metrics_->RpcStarted(children_);
  }

  ~MetricsInterceptor() override {
    // A call torn down without a status (e.g. the client went away first).
    if (!finished_) Finish(grpc::StatusCode::CANCELLED);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS) && !finished_) {
      Finish(methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  void Finish(grpc::StatusCode code) {
    finished_ = true;
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    metrics_->RpcFinished(children_, code, seconds);
  }

  ServerMetrics* const metrics_;
  ServerMetrics::RpcChildren& children_;  // resolved once per method, owned by metrics_
  const std::chrono::steady_clock::time_point start_;
  bool finished_ = false;
};

}  // namespace

grpc::experimental::Interceptor* MetricsInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  if (info->method() != nullptr && recorded_elsewhere_.contains(absl::string_view(info->method()))) return nullptr;
  return new MetricsInterceptor(info, metrics_);
}

}  // namespace mlakv::server
