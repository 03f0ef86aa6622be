// ThreadSanitizer builds only (MLAKV_SANITIZE=thread): the one ordering of
// gRPC's call API that TSan cannot see, told to it.
//
// Why: a reactor (or a blocking stub) starts an operation on one thread —
// Finish() or StartWrite() on a pool's worker — and gRPC runs its completion,
// OnWriteDone() or OnDone() (which deletes the reactor), on one of its own
// threads. gRPC guarantees that the start happens before the completion, but
// the hand-over happens inside libgrpc (uninstrumented, lock-free), so TSan
// reports every reactor member written before the start and touched in the
// completion as a race: a false report, in every reactor of the service.
//
// How: this file defines two functions of gRPC's C core under their own
// names. libgrpc++ calls both through its PLT, so in a program linked with
// this file (cmake/tsan_sync.cmake exports them) they bind here:
//  * grpc_call_start_batch(call, ...): every operation of every reactor and
//    stub is started here (CallOpSet::ContinueFillOpsAfterInterception);
//    it releases on `call` first;
//  * grpc_call_unref(call): grpcpp's CallOpSet::FinalizeResult drops the
//    batch's call reference with it after reading the batch's results and
//    before it runs the reactor's callback (CallbackWithSuccessTag::Run);
//    it acquires on `call` first.
// So everything a thread did before starting any operation on a call happens
// before everything that runs after a later completion of that call. That is
// gRPC's own contract, widened from one batch to the call: two operations of
// the same RPC racing each other may go unreported when one started before
// the other completed. Races between RPCs, with the pool's worker, and with
// anything not started through gRPC stay visible.
//
// Not covered: what grpcpp's FinalizeResult reads before it drops the
// reference (its own CallOpSet fields, the received bytes) — gRPC's memory,
// suppressed by name in tests/sanitize/tsan.supp.

#include <dlfcn.h>
#include <grpc/grpc.h>
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

}  // namespace

extern "C" grpc_call_error grpc_call_start_batch(grpc_call* call, const grpc_op* ops, size_t nops, void* tag,
                                                 void* reserved) {
  static auto* const next = Next<decltype(grpc_call_start_batch)>("grpc_call_start_batch");
  __tsan_release(call);
  return next(call, ops, nops, tag, reserved);
}

extern "C" void grpc_call_unref(grpc_call* call) {
  static auto* const next = Next<decltype(grpc_call_unref)>("grpc_call_unref");
  __tsan_acquire(call);
  next(call);
}
