#include "server/cq/calls.h"

namespace mlakv::server::cq {

Call::Call(QueueThreads* queue, bool counts_as_load) : queue_(queue), counts_as_load_(counts_as_load) {
  queue_->CallCreated();
}

Call::~Call() {
  if (counted_) queue_->CallIdle();
  queue_->CallDeleted();
}

void Call::Arm(Call* call) {
  // The done notification is asked for before the request: gRPC returns it
  // once the call has started and ended (or was cancelled), never for a
  // request that comes back not ok.
  call->ctx_.AsyncNotifyWhenDone(&call->done_tag_);
  MLAKV_TSAN_HAPPENS_BEFORE(&call->request_tag_);
  call->Request(&call->request_tag_);
}

void Call::OnRequest(bool ok) {
  if (!ok) {
    // The server is shutting down: no call came, no done notification will.
    delete this;
    return;
  }
  // The next request of this method is armed before this one is handled, so
  // that calls keep being accepted while it runs (on another queue thread).
  Arm(NextCall());
  if (counts_as_load_) {
    counted_ = true;
    queue_->CallBusy();
  }
  OnStart();
  if (start_state_.fetch_or(kStartReturned, std::memory_order_acq_rel) & kCancelSeen) OnCancel();
  OperationEnded();  // OnStart's own count (operations_ starts at 2)
}

void Call::OnDoneTag(bool) {
  if (ctx_.IsCancelled()) {  // may be asked now, and only now, on this API
    ctx_.MarkCancelled();
    if (start_state_.fetch_or(kCancelSeen, std::memory_order_acq_rel) & kStartReturned) OnCancel();
  }
  OperationEnded();
}

void Call::ReadFailed() {
  if (grpc_call_failed_before_recv_message(ctx_.c_call()) != 0) ctx_.MarkCancelled();
}

void Call::FinishStarted() {
  // Finish's operation and the mark in one step: the count reaches exactly
  // kFinishing once, when the last operation after Finish is back.
  operations_.fetch_add(kFinishing + 1, std::memory_order_acq_rel);
}

void Call::OperationEnded() {
  // The reactions of every operation happen before OnDone (acq_rel).
  if (operations_.fetch_sub(1, std::memory_order_acq_rel) == kFinishing + 1) OnDone();
}

}  // namespace mlakv::server::cq
