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
      : metrics_(metrics), start_(std::chrono::steady_clock::now()) {
    // "/package.Service/Method"
    std::string full = info->method() ? info->method() : "";
    size_t slash = full.rfind('/');
    if (slash != std::string::npos && slash > 0) {
      service_ = full.substr(1, slash - 1);
      method_ = full.substr(slash + 1);
    } else {
      service_ = "unknown";
      method_ = full.empty() ? "unknown" : full;
    }
    metrics_->RpcStarted(service_, method_);
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
    metrics_->RpcFinished(service_, method_, code, seconds);
  }

  ServerMetrics* const metrics_;
  const std::chrono::steady_clock::time_point start_;
  std::string service_, method_;
  bool finished_ = false;
};

}  // namespace

grpc::experimental::Interceptor* MetricsInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new MetricsInterceptor(info, metrics_);
}

}  // namespace mlakv::server
