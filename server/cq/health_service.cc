#include "server/cq/health_service.h"

#include <optional>

namespace mlakv::server::cq {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// One Watch stream: the status when it starts, then each change, one write
// in flight at a time. What is left to send is the latest status only, so a
// client that reads slowly gets the newest state, not a backlog.
class HealthService::WatchCall final : public WriterCall<HealthCheckRequest, HealthCheckResponse> {
 public:
  WatchCall(HealthService* health, QueueThreads* queue) : WriterCall(queue), health_(health) {}

  // The status of the known names is now `status`. Called with health_->mu_
  // held (not annotated: the analysis cannot see that health_ is the caller):
  // the watch is in health_->watches_, so its OnDone has not run.
  void Changed(HealthCheckResponse::ServingStatus status) {
    absl::MutexLock lock(&mu_);
    if (!known_) return;  // SERVICE_UNKNOWN does not change
    pending_ = status;
    StartNextLocked();
  }

 private:
  void Request(void* tag) override {
    health_->service_.RequestWatch(&ctx_, request(), writer(), queue_->queue(), queue_->queue(), tag);
  }
  Call* NextCall() override { return new WatchCall(health_, queue_); }

  void OnStart() override {
    // Both locks for the whole start: the watch joins the set and takes the
    // status in one step with SetServing, so no change falls between. And
    // OnDone, which takes health_->mu_ first, cannot delete the call before
    // this has let go of both.
    absl::MutexLock health_lock(&health_->mu_);
    absl::MutexLock lock(&mu_);
    pending_ = health_->StatusLocked(request()->service());
    known_ = *pending_ != HealthCheckResponse::SERVICE_UNKNOWN;
    health_->watches_.insert(this);
    StartNextLocked();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      FinishLocked(grpc::Status::CANCELLED);  // the stream broke
      return;
    }
    StartNextLocked();
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);  // after OnStart returned (cq/calls.h)
    FinishLocked(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&health_->mu_);
      health_->watches_.erase(this);
    }
    Call::OnDone();
  }

  void StartNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_ || !pending_.has_value()) return;
    if (*pending_ == sent_) {
      pending_.reset();
      return;
    }
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

  HealthService* const health_;
  absl::Mutex mu_;
  bool known_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<HealthCheckResponse::ServingStatus> pending_ ABSL_GUARDED_BY(mu_);
  std::optional<HealthCheckResponse::ServingStatus> sent_ ABSL_GUARDED_BY(mu_);
  HealthCheckResponse response_ ABSL_GUARDED_BY(mu_);  // the write in flight
};

HealthService::HealthService(const std::vector<std::string>& services) : known_(services.begin(), services.end()) {}

HealthService::~HealthService() = default;

void HealthService::Serve(QueueThreads* queue) {
  grpc::ServerCompletionQueue* cq = queue->queue();
  check_.request = [this, cq](grpc::ServerContext* ctx, HealthCheckRequest* req,
                              grpc::ServerAsyncResponseWriter<HealthCheckResponse>* responder, void* tag) {
    service_.RequestCheck(ctx, req, responder, cq, cq, tag);
  };
  check_.handle = [this](CheckCall* call) { Check(call); };
  CheckCall::Serve(queue, &check_);
  Call::Arm(new WatchCall(this, queue));
}

void HealthService::Check(CheckCall* call) {
  const HealthCheckResponse::ServingStatus status = Status(call->request().service());
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    call->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service"));
    return;
  }
  call->response()->set_status(status);
  call->Finish(grpc::Status::OK);
}

HealthCheckResponse::ServingStatus HealthService::Status(const std::string& service) const {
  absl::ReaderMutexLock lock(&mu_);
  return StatusLocked(service);
}

HealthCheckResponse::ServingStatus HealthService::StatusLocked(const std::string& service) const {
  if (!service.empty() && !known_.contains(service)) return HealthCheckResponse::SERVICE_UNKNOWN;
  return serving_ ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
}

void HealthService::SetServing(bool serving) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  Publish(serving);
}

void HealthService::Shutdown() {
  absl::MutexLock lock(&mu_);
  shut_down_ = true;
  Publish(false);
}

void HealthService::Publish(bool serving) {
  serving_ = serving;
  const HealthCheckResponse::ServingStatus status =
      serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
  for (WatchCall* watch : watches_) watch->Changed(status);
}

}  // namespace mlakv::server::cq
