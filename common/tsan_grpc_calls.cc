// ThreadSanitizer builds only (MLAKV_SANITIZE=thread): the ordering of gRPC's
// call API that TSan cannot see -- an operation's start happens before its
// completion -- told to it.
//
// Why: a reactor (or a blocking stub) starts an operation on one thread —
// Finish() or StartWrite() on a pool's worker — and gRPC runs its completion,
// OnWriteDone() or OnDone() (which deletes the reactor), on one of its own
// threads. gRPC guarantees that the start happens before the completion, but
// the hand-over happens inside libgrpc (uninstrumented, lock-free), so TSan
// reports every reactor member written before the start and touched in the
// completion as a race: a false report, in every reactor of the service.
//
// How: this file defines grpc_call_start_batch and grpc_call_unref, two
// functions of gRPC's C core, under their own names. libgrpc++ calls both
// through its PLT, so in a program linked with this file (cmake/tsan_sync.cmake
// exports them) they bind here:
//  * grpc_call_start_batch(call, ops, n, tag): every operation of every
//    reactor and stub is started here; it releases on `tag` and on `call`.
//    When `tag` is a grpcpp callback tag (a grpc_completion_queue_functor run
//    by CallbackWithSuccessTag::StaticRun, what reactors' operations use),
//    its functor_run is pointed at RunAfterAcquire, which acquires on `tag`
//    and then calls StaticRun: the batch's start happens-before its whole
//    completion, results and interceptors included -- gRPC's own contract,
//    batch by batch;
//  * grpc_call_unref(call): grpcpp's CallOpSet::FinalizeResult drops the
//    batch's call reference with it before running the callback, also for
//    completion-queue (blocking stub) batches; it acquires on `call`. That
//    orders everything a thread did before starting an operation on a call
//    before what runs after a later completion of that call: gRPC's contract
//    widened from one batch to the call (two operations of one RPC racing
//    each other may then go unreported). Races between RPCs, with the pool's
//    worker, and with anything not started through gRPC stay visible.
//
//  * grpc_server_request_call / grpc_server_request_registered_call(...,
//    tag_new): the completion-queue API's requests for a call (cq/calls.h);
//    they release on `tag_new`, grpcpp's request object, which the request
//    wrote (its payload buffer, context) before asking;
//  * grpc_completion_queue_next: what the completion-queue API's threads
//    take their completions from (cq/queue_threads.h); it acquires on the
//    event's tag, before grpcpp's FinalizeResult reads the request object or
//    the batch's results and before the program's own step runs. With the
//    releases above, a request's or a batch's start happens-before whatever
//    its completion runs on the queue's thread, as gRPC guarantees.
//
// Not covered: OnDone, which grpcpp schedules from whichever thread dropped
// the last of its callback references, some in libgrpc++ (an uninstrumented
// atomic): tests/sanitize/tsan.supp, race:*::CallOnDone.
//
// The tag check reads the first word of `tag`: every tag passed to
// grpc_call_start_batch here is an object (a CallOpSet, grpcpp's done
// notification or a callback tag), never an arbitrary pointer: the
// completion-queue API's programs give their own tags to grpcpp, which
// passes its own objects to the core.

#include <dlfcn.h>
#include <grpc/grpc.h>
#include <grpcpp/support/callback_common.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>

namespace {

template <typename F>
F* Next(const char* symbol) {
  void* f = dlsym(RTLD_NEXT, symbol);
  if (f == nullptr) {
    std::fprintf(stderr, "tsan_grpc_calls: no definition of %s after the executable's (%s)\n", symbol, dlerror());
    std::abort();
  }
  return reinterpret_cast<F*>(f);
}

// CallbackWithSuccessTag::StaticRun is private; an explicit instantiation
// may name it (the standard's access exemption for explicit instantiations),
// which hands its address to StaticRunOfCallbackTag().
using FunctorRun = void (*)(grpc_completion_queue_functor*, int);
struct StaticRunKey {
  friend FunctorRun StaticRunOfCallbackTag(StaticRunKey);
};
template <FunctorRun kRun>
struct ExposeStaticRun {
  friend FunctorRun StaticRunOfCallbackTag(StaticRunKey) { return kRun; }
};
template struct ExposeStaticRun<&grpc::internal::CallbackWithSuccessTag::StaticRun>;
FunctorRun StaticRunOfCallbackTag(StaticRunKey);

// libgrpc runs a callback tag's completion through functor_run.
void RunAfterAcquire(grpc_completion_queue_functor* tag, int ok) {
  __tsan_acquire(tag);
  StaticRunOfCallbackTag(StaticRunKey{})(tag, ok);
}

}  // namespace

extern "C" grpc_call_error grpc_call_start_batch(grpc_call* call, const grpc_op* ops, size_t nops, void* tag,
                                                 void* reserved) {
  static auto* const next = Next<decltype(grpc_call_start_batch)>("grpc_call_start_batch");
  if (tag != nullptr) {
    auto* functor = static_cast<grpc_completion_queue_functor*>(tag);
    if (functor->functor_run == StaticRunOfCallbackTag(StaticRunKey{})) functor->functor_run = &RunAfterAcquire;
    __tsan_release(tag);
  }
  __tsan_release(call);
  return next(call, ops, nops, tag, reserved);
}

extern "C" void grpc_call_unref(grpc_call* call) {
  static auto* const next = Next<decltype(grpc_call_unref)>("grpc_call_unref");
  __tsan_acquire(call);
  next(call);
}

extern "C" grpc_call_error grpc_server_request_call(grpc_server* server, grpc_call** call, grpc_call_details* details,
                                                    grpc_metadata_array* request_metadata,
                                                    grpc_completion_queue* cq_bound_to_call,
                                                    grpc_completion_queue* cq_for_notification, void* tag_new) {
  static auto* const next = Next<decltype(grpc_server_request_call)>("grpc_server_request_call");
  __tsan_release(tag_new);
  return next(server, call, details, request_metadata, cq_bound_to_call, cq_for_notification, tag_new);
}

extern "C" grpc_call_error grpc_server_request_registered_call(grpc_server* server, void* registered_method,
                                                               grpc_call** call, gpr_timespec* deadline,
                                                               grpc_metadata_array* request_metadata,
                                                               grpc_byte_buffer** optional_payload,
                                                               grpc_completion_queue* cq_bound_to_call,
                                                               grpc_completion_queue* cq_for_notification,
                                                               void* tag_new) {
  static auto* const next =
      Next<decltype(grpc_server_request_registered_call)>("grpc_server_request_registered_call");
  __tsan_release(tag_new);
  return next(server, registered_method, call, deadline, request_metadata, optional_payload, cq_bound_to_call,
              cq_for_notification, tag_new);
}

extern "C" grpc_event grpc_completion_queue_next(grpc_completion_queue* cq, gpr_timespec deadline, void* reserved) {
  static auto* const next = Next<decltype(grpc_completion_queue_next)>("grpc_completion_queue_next");
  const grpc_event event = next(cq, deadline, reserved);
  if (event.type == GRPC_OP_COMPLETE && event.tag != nullptr) __tsan_acquire(event.tag);
  return event;
}
