#include "server/observability/probe_health_service.h"

#include <optional>

#include "mlakv/v1/kv_cache.grpc.pb.h"

namespace mlakv::server {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// Writes the current status, then each change, one write at a time, until
// the client cancels or the server shuts down.
class ProbeHealthService::WatchReactor final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  WatchReactor(ProbeHealthService* service, bool known) : service_(service), known_(known) {
    absl::MutexLock lock(&mu_);
    pending_ = Current();
    StartNextLocked();
  }

  // A status change (called with the service's watcher lock held).
  void Changed() {
    absl::MutexLock lock(&mu_);
    pending_ = Current();
    if (!writing_) StartNextLocked();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      FinishLocked(grpc::Status::CANCELLED);
      return;
    }
    StartNextLocked();
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    FinishLocked(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&service_->mu_);
      service_->watchers_.erase(this);
    }
    delete this;
  }

 private:
  HealthCheckResponse::ServingStatus Current() const {
    return known_ ? service_->Status() : HealthCheckResponse::SERVICE_UNKNOWN;
  }
  void StartNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_ || !pending_ || *pending_ == sent_) return;
    response_.set_status(*pending_);
    sent_ = *pending_;
    pending_.reset();
    writing_ = true;
    StartWrite(&response_);
  }
  void FinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    Finish(status);
  }

  ProbeHealthService* const service_;
  const bool known_;
  absl::Mutex mu_;
  HealthCheckResponse response_;
  std::optional<HealthCheckResponse::ServingStatus> pending_ ABSL_GUARDED_BY(mu_);
  std::optional<HealthCheckResponse::ServingStatus> sent_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

ProbeHealthService::~ProbeHealthService() = default;

bool ProbeHealthService::Known(const std::string& service) {
  return service.empty() || service == v1::KvCache::service_full_name();
}

HealthCheckResponse::ServingStatus ProbeHealthService::Status() const {
  return serving_.load() ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
}

void ProbeHealthService::SetServing(bool serving) {
  serving_.store(serving);
  absl::MutexLock lock(&mu_);
  for (WatchReactor* w : watchers_) w->Changed();
}

grpc::ServerUnaryReactor* ProbeHealthService::Check(grpc::CallbackServerContext* ctx, const HealthCheckRequest* req,
                                                    HealthCheckResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (!Known(req->service())) {
    reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service"));
  } else {
    resp->set_status(Status());
    reactor->Finish(grpc::Status::OK);
  }
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* ProbeHealthService::Watch(grpc::CallbackServerContext*,
                                                                         const HealthCheckRequest* req) {
  auto* reactor = new WatchReactor(this, Known(req->service()));
  absl::MutexLock lock(&mu_);
  watchers_.insert(reactor);
  return reactor;
}

}  // namespace mlakv::server
