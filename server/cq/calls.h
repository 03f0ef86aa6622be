// Calls on the completion-queue API, driven the way gRPC's reactors are.
//
// Each call is an object that asks gRPC for its method's next request
// (Call::Arm), and once one comes, arms the next object for the method and
// handles its own. The stream classes offer what a callback reactor offers
// -- StartRead / StartWrite / Finish, OnReadDone / OnWriteDone / OnCancel /
// OnDone -- with the same contract:
//  * at most one read and one write in flight; Finish exactly once, from any
//    thread, after which nothing else is started (a read may still be in
//    flight: it comes back not ok);
//  * every reaction runs on a queue thread (QueueThreads), possibly before
//    the StartRead / StartWrite that caused it has returned;
//  * OnDone runs once, after Finish's operation and every other operation
//    (the call's "done" notification included) came back and their
//    reactions returned; it deletes the call unless overridden.
//
// What the completion-queue API tells only through tags is kept on the
// call's context (CallContext::cancelled): a read that failed because the
// call broke (gRPC's grpc_call_failed_before_recv_message, which the
// callback API checks the same way), and the done notification of a
// cancelled call. ServerContext::IsCancelled itself may only be asked after
// that notification on this API.
#pragma once

#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/async_stream.h>
#include <grpcpp/support/async_unary_call.h>

#include <atomic>
#include <functional>
#include <memory>

#include "common/tsan_annotations.h"
#include "server/cq/message_recycler.h"
#include "server/cq/queue_threads.h"

namespace mlakv::server::cq {

// A tag that runs one member function of a call.
template <class T, void (T::*kStep)(bool)>
class StepTag final : public Tag {
 public:
  explicit StepTag(T* call) : call_(call) {}
  void Proceed(bool ok) override { (call_->*kStep)(ok); }

 private:
  T* const call_;
};

// The context of a call on this API, with whether it broke.
class CallContext : public grpc::ServerContext {
 public:
  // The client cancelled, the deadline passed, the transport broke or the
  // server's shutdown cancelled the call -- as far as this side has heard.
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

 private:
  friend class Call;
  void MarkCancelled() { cancelled_.store(true, std::memory_order_release); }
  std::atomic<bool> cancelled_{false};
};

class Call {
 public:
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  // Asks for the method's next request; the call owns itself from here.
  static void Arm(Call* call);

  CallContext* context() { return &ctx_; }

 protected:
  // `counts_as_load`: from its request to its deletion the call counts
  // toward the queue's calls in progress (QueueThreads::CallBusy), which
  // decide how many threads poll. Server streams say no: a WatchEvents or
  // Read stream spends its life waiting, and what it moves goes out as
  // writes, not as reads off a socket.
  explicit Call(QueueThreads* queue, bool counts_as_load = true);
  virtual ~Call();

  // The generated RequestXxx of the call's method, with `tag`.
  virtual void Request(void* tag) = 0;
  // A fresh call of the same method, armed as soon as this one matched.
  virtual Call* NextCall() = 0;
  // The request came: handle it (on the queue thread that took it).
  virtual void OnStart() = 0;
  // The call was cancelled; on a queue thread, at most once, after OnStart
  // returned and before OnDone.
  virtual void OnCancel() {}
  virtual void OnDone() { delete this; }

  // Accounting of the operations whose tags come back, for the subclasses:
  // OperationStarted before starting one, OperationEnded after its reaction
  // returned; FinishStarted before starting Finish's.
  void OperationStarted() { operations_.fetch_add(1, std::memory_order_relaxed); }
  void OperationEnded();
  void FinishStarted();
  // A read came back not ok because the call broke (not a half-close).
  void ReadFailed();

  CallContext ctx_;
  QueueThreads* const queue_;

 private:
  void OnRequest(bool ok);
  void OnDoneTag(bool ok);

  StepTag<Call, &Call::OnRequest> request_tag_{this};
  StepTag<Call, &Call::OnDoneTag> done_tag_{this};
  const bool counts_as_load_;
  bool counted_ = false;  // CallBusy was called (on the request's match)
  // Operations in flight, plus kFinishing once Finish was started. A call
  // that matched a request owes two from the start: its done notification,
  // and OnStart itself -- so that neither a cancellation nor a Finish from
  // another thread can run OnDone while OnStart is still running. (A request
  // that comes back not ok deletes the call without counting.)
  static constexpr int kFinishing = 1 << 24;
  std::atomic<int> operations_{2};
  // Who runs OnCancel: the done notification of a cancelled call may be
  // taken by another thread before OnStart has returned; then the thread
  // that returns from OnStart runs it instead. Exactly one of the two sees
  // the other's bit.
  static constexpr int kStartReturned = 1;
  static constexpr int kCancelSeen = 2;
  std::atomic<int> start_state_{0};
};

// A unary method: the handler runs on the queue thread that took the call
// and calls Finish once, there or later from any thread.
template <class Req, class Resp>
class UnaryCall final : public Call {
 public:
  struct Method {
    // The generated RequestXxx, bound to its service and queue.
    std::function<void(grpc::ServerContext*, Req*, grpc::ServerAsyncResponseWriter<Resp>*, void*)> request;
    std::function<void(UnaryCall*)> handle;
    // Where the calls take their messages from and give them back when they
    // end (message_recycler.h); null: each call makes its own.
    MessageRecycler<Req>* requests = nullptr;
    MessageRecycler<Resp>* responses = nullptr;
  };
  // Serves `method` (which outlives the queue's calls) from now on.
  static void Serve(QueueThreads* queue, const Method* method) { Arm(new UnaryCall(queue, method)); }

  const Req& request() const { return *request_; }
  Resp* response() { return response_.get(); }
  // Sends the response with an OK status, else the status alone.
  void Finish(const grpc::Status& status) {
    FinishStarted();
    MLAKV_TSAN_HAPPENS_BEFORE(&finish_tag_);
    if (status.ok()) {
      responder_.Finish(*response_, status, &finish_tag_);
    } else {
      responder_.FinishWithError(status, &finish_tag_);
    }
  }

 private:
  UnaryCall(QueueThreads* queue, const Method* method)
      : Call(queue),
        method_(method),
        request_(method->requests != nullptr ? method->requests->Take() : std::make_unique<Req>()),
        response_(method->responses != nullptr ? method->responses->Take() : std::make_unique<Resp>()) {}
  ~UnaryCall() override {
    if (method_->requests != nullptr) method_->requests->Give(std::move(request_));
    if (method_->responses != nullptr) method_->responses->Give(std::move(response_));
  }
  void Request(void* tag) override { method_->request(&ctx_, request_.get(), &responder_, tag); }
  Call* NextCall() override { return new UnaryCall(queue_, method_); }
  void OnStart() override { method_->handle(this); }
  void OnFinished(bool) { OperationEnded(); }

  const Method* const method_;
  std::unique_ptr<Req> request_;
  std::unique_ptr<Resp> response_;
  grpc::ServerAsyncResponseWriter<Resp> responder_{&ctx_};
  StepTag<UnaryCall, &UnaryCall::OnFinished> finish_tag_{this};
};

// A client-streaming method (the client sends Req messages, the server
// answers one Resp).
template <class Req, class Resp>
class ReaderCall : public Call {
 protected:
  explicit ReaderCall(QueueThreads* queue) : Call(queue) {}

  virtual void OnReadDone(bool ok) = 0;
  void StartRead(Req* message) {
    OperationStarted();
    MLAKV_TSAN_HAPPENS_BEFORE(&read_tag_);
    reader_.Read(message, &read_tag_);
  }
  // Sends *response() with an OK status, else the status alone.
  void Finish(const grpc::Status& status) {
    FinishStarted();
    MLAKV_TSAN_HAPPENS_BEFORE(&finish_tag_);
    if (status.ok()) {
      reader_.Finish(response_, status, &finish_tag_);
    } else {
      reader_.FinishWithError(status, &finish_tag_);
    }
  }
  Resp* response() { return &response_; }
  grpc::ServerAsyncReader<Resp, Req>* reader() { return &reader_; }

 private:
  void OnRead(bool ok) {
    if (!ok) ReadFailed();
    OnReadDone(ok);
    OperationEnded();
  }
  void OnFinished(bool) { OperationEnded(); }

  Resp response_;
  grpc::ServerAsyncReader<Resp, Req> reader_{&ctx_};
  StepTag<ReaderCall, &ReaderCall::OnRead> read_tag_{this};
  StepTag<ReaderCall, &ReaderCall::OnFinished> finish_tag_{this};
};

// A server-streaming method (one Req, Resp messages back).
template <class Req, class Resp>
class WriterCall : public Call {
 protected:
  explicit WriterCall(QueueThreads* queue) : Call(queue, /*counts_as_load=*/false) {}

  virtual void OnWriteDone(bool /*ok*/) {}
  void StartWrite(const Resp* message) {
    OperationStarted();
    MLAKV_TSAN_HAPPENS_BEFORE(&write_tag_);
    writer_.Write(*message, &write_tag_);
  }
  void Finish(const grpc::Status& status) {
    FinishStarted();
    MLAKV_TSAN_HAPPENS_BEFORE(&finish_tag_);
    writer_.Finish(status, &finish_tag_);
  }
  Req* request() { return &request_; }
  grpc::ServerAsyncWriter<Resp>* writer() { return &writer_; }

 private:
  void OnWrite(bool ok) {
    OnWriteDone(ok);
    OperationEnded();
  }
  void OnFinished(bool) { OperationEnded(); }

  Req request_;
  grpc::ServerAsyncWriter<Resp> writer_{&ctx_};
  StepTag<WriterCall, &WriterCall::OnWrite> write_tag_{this};
  StepTag<WriterCall, &WriterCall::OnFinished> finish_tag_{this};
};

// A bidirectional-streaming method.
template <class Req, class Resp>
class ReaderWriterCall : public Call {
 protected:
  explicit ReaderWriterCall(QueueThreads* queue) : Call(queue) {}

  virtual void OnReadDone(bool ok) = 0;
  virtual void OnWriteDone(bool /*ok*/) {}
  void StartRead(Req* message) {
    OperationStarted();
    MLAKV_TSAN_HAPPENS_BEFORE(&read_tag_);
    stream_.Read(message, &read_tag_);
  }
  void StartWrite(const Resp* message) {
    OperationStarted();
    MLAKV_TSAN_HAPPENS_BEFORE(&write_tag_);
    stream_.Write(*message, &write_tag_);
  }
  void Finish(const grpc::Status& status) {
    FinishStarted();
    MLAKV_TSAN_HAPPENS_BEFORE(&finish_tag_);
    stream_.Finish(status, &finish_tag_);
  }
  grpc::ServerAsyncReaderWriter<Resp, Req>* stream() { return &stream_; }

 private:
  void OnRead(bool ok) {
    if (!ok) ReadFailed();
    OnReadDone(ok);
    OperationEnded();
  }
  void OnWrite(bool ok) {
    OnWriteDone(ok);
    OperationEnded();
  }
  void OnFinished(bool) { OperationEnded(); }

  grpc::ServerAsyncReaderWriter<Resp, Req> stream_{&ctx_};
  StepTag<ReaderWriterCall, &ReaderWriterCall::OnRead> read_tag_{this};
  StepTag<ReaderWriterCall, &ReaderWriterCall::OnWrite> write_tag_{this};
  StepTag<ReaderWriterCall, &ReaderWriterCall::OnFinished> finish_tag_{this};
};

}  // namespace mlakv::server::cq
