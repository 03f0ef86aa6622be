#include "server/cq/unknown_methods.h"

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/tsan_annotations.h"

namespace mlakv::server::cq {

// One call of an unknown method: asked for, answered with its status at
// once (the client's messages are never read: gRPC discards them), deleted
// when the status was sent. It needs no done notification or operation
// count of cq/calls.h: it starts exactly one operation, and only that
// operation's completion deletes it.
class UnknownMethods::Call final {
 public:
  Call(UnknownMethods* methods, QueueThreads* queue) : methods_(methods), queue_(queue) { queue_->CallCreated(); }
  ~Call() { queue_->CallDeleted(); }

  void Arm() {
    MLAKV_TSAN_HAPPENS_BEFORE(&request_tag_);
    methods_->service_.RequestCall(&ctx_, &stream_, queue_->queue(), queue_->queue(), &request_tag_);
  }

 private:
  void OnRequest(bool ok) {
    if (!ok) {  // the server is shutting down: no call came
      delete this;
      return;
    }
    (new Call(methods_, queue_))->Arm();
    MLAKV_TSAN_HAPPENS_BEFORE(&finish_tag_);
    stream_.Finish(methods_->StatusFor(ctx_.method()), &finish_tag_);
  }
  void OnFinished(bool) { delete this; }

  class Step final : public Tag {
   public:
    Step(Call* call, void (Call::*step)(bool)) : call_(call), step_(step) {}
    void Proceed(bool ok) override { (call_->*step_)(ok); }

   private:
    Call* const call_;
    void (Call::*const step_)(bool);
  };

  UnknownMethods* const methods_;
  QueueThreads* const queue_;
  grpc::GenericServerContext ctx_;
  grpc::GenericServerAsyncReaderWriter stream_{&ctx_};
  Step request_tag_{this, &Call::OnRequest};
  Step finish_tag_{this, &Call::OnFinished};
};

void UnknownMethods::Serve(QueueThreads* queue) { (new Call(this, queue))->Arm(); }

grpc::Status UnknownMethods::StatusFor(const std::string& path) const {
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                      absl::StrCat("unknown method ", Quote(path), ": this server serves ", served_,
                                   " (check the client's proto and the service name)"));
}

}  // namespace mlakv::server::cq
