// Happens-before annotations for ThreadSanitizer, for orderings that TSan
// cannot see because they are made inside an uninstrumented library.
//
//   MLAKV_TSAN_HAPPENS_BEFORE(p);  // on the thread handing over, before the hand-over
//   MLAKV_TSAN_HAPPENS_AFTER(p);   // on the thread taking over, after it
//
// Everything the first thread did before HAPPENS_BEFORE(p) happens-before
// everything the second does after a later HAPPENS_AFTER(p), for TSan. State
// only orderings a library guarantees: the point is a report-free run that
// still checks everything else, not silencing a real race. The use this was
// written for is gRPC's reactor contract (Finish() happens before OnDone()),
// whose hand-over is lock-free inside libgrpc:
//
//   MLAKV_TSAN_HAPPENS_BEFORE(this);  Finish(status);
//   void OnDone() override { MLAKV_TSAN_HAPPENS_AFTER(this); delete this; }
//
// Both are no-ops (and evaluate nothing) outside -fsanitize=thread builds.
#pragma once

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MLAKV_TSAN_ENABLED 1
#endif
#endif
#if !defined(MLAKV_TSAN_ENABLED) && defined(__SANITIZE_THREAD__)
#define MLAKV_TSAN_ENABLED 1
#endif

#ifdef MLAKV_TSAN_ENABLED
#include <sanitizer/tsan_interface.h>
#define MLAKV_TSAN_HAPPENS_BEFORE(p) __tsan_release(const_cast<void*>(static_cast<const volatile void*>(p)))
#define MLAKV_TSAN_HAPPENS_AFTER(p) __tsan_acquire(const_cast<void*>(static_cast<const volatile void*>(p)))
#else
#define MLAKV_TSAN_HAPPENS_BEFORE(p) static_cast<void>(0)
#define MLAKV_TSAN_HAPPENS_AFTER(p) static_cast<void>(0)
#endif
