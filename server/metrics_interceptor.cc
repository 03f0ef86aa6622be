#include "server/metrics_interceptor.h"

#include <chrono>
#include <string>

#include "mlakv/v1/kv_cache.pb.h"

namespace mlakv::server {
namespace {

using grpc::experimental::InterceptionHookPoints;

constexpr char kKvCacheService[] = "mlakv.v1.KvCache";

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
    if (service_ == kKvCacheService) {
      if (method_ == "Append") kind_ = Kind::kAppend;
      if (method_ == "AppendBatch") kind_ = Kind::kAppendBatch;
    }
    metrics_->RpcStarted(service_, method_);
  }

  ~MetricsInterceptor() override {
    // A call torn down without a status (e.g. the client went away first).
    if (!finished_) Finish(grpc::StatusCode::CANCELLED);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (kind_ != Kind::kOther && methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      if (const void* msg = methods->GetRecvMessage()) CountRequest(msg);
    }
    if (kind_ != Kind::kOther && methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
      if (const void* msg = methods->GetSendMessage()) {
        rows_ = kind_ == Kind::kAppend ? static_cast<const v1::AppendResponse*>(msg)->rows_written()
                                       : static_cast<const v1::AppendBatchResponse*>(msg)->rows_written();
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS) && !finished_) {
      Finish(methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  enum class Kind { kOther, kAppend, kAppendBatch };

  static uint64_t LayerBytes(const v1::LayerRows& l) { return l.ckv().size() + l.kpe().size(); }

  void CountRequest(const void* msg) {
    if (kind_ == Kind::kAppend) {
      const auto& req = *static_cast<const v1::AppendRequest*>(msg);
      if (pool_.empty() && !req.pool().empty()) pool_ = req.pool();
      for (const auto& l : req.layers()) bytes_ += LayerBytes(l);
    } else {
      const auto& req = *static_cast<const v1::AppendBatchRequest*>(msg);
      pool_ = req.pool();
      for (const auto& s : req.sequences()) {
        for (const auto& l : s.layers()) bytes_ += LayerBytes(l);
      }
    }
  }

  void Finish(grpc::StatusCode code) {
    finished_ = true;
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    metrics_->RpcFinished(service_, method_, code, seconds);
    if (kind_ != Kind::kOther) {
      metrics_->AppendFinished(method_, pool_, code == grpc::StatusCode::OK, rows_, bytes_, seconds);
    }
  }

  ServerMetrics* const metrics_;
  const std::chrono::steady_clock::time_point start_;
  std::string service_, method_;
  Kind kind_ = Kind::kOther;
  std::string pool_;  // as named by the request; empty = the default pool
  uint64_t rows_ = 0;
  uint64_t bytes_ = 0;
  bool finished_ = false;
};

}  // namespace

grpc::experimental::Interceptor* MetricsInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new MetricsInterceptor(info, metrics_);
}

}  // namespace mlakv::server
