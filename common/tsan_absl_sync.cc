// ThreadSanitizer builds only (MLAKV_SANITIZE=thread): tells TSan what
// abseil's synchronization primitives do, because Debian's libabsl is not
// compiled with -fsanitize=thread.
//
// Why: absl::Mutex::Lock/Unlock, Mutex::Await, CondVar::Wait and
// Notification::Notify live in libabsl_synchronization.so. In an
// uninstrumented build of that library their atomics and futex waits are
// invisible to TSan, so TSan sees no happens-before between an Unlock on one
// thread and the next Lock on another, and reports every access to
// ABSL_GUARDED_BY data as a race (a false report). abseil's own TSan
// annotations (ABSL_TSAN_MUTEX_*) are compiled into mutex.cc only when abseil
// itself is built with TSan, which Debian's is not.
//
// How: this file defines those functions itself, under their mangled names,
// in every TSan executable (cmake/tsan_sync.cmake links it whole). Each
// definition calls the real one in libabsl_synchronization.so (found with
// dlsym(RTLD_NEXT)) between the same __tsan_mutex_* annotations that
// abseil's TSan build has. The project's own calls bind to these at link
// time; calls from shared libraries (gRPC's core, protobuf, abseil itself)
// bind to them at run time, because a definition in the executable comes
// first in ELF symbol lookup. TSan then models every absl::Mutex in the
// process as a mutex: an unlock happens-before the next lock, and lock order
// is checked. Nothing is suppressed: an access to guarded data without the
// lock is still a race, and is still reported.
//
// Not modelled: synchronization that gRPC's core does with its own atomics
// (it is uninstrumented; see scripts/sanitize.sh for what that means for the
// tests). A condition passed to Await/LockWhen is evaluated by abseil
// (sometimes on the unlocking thread) inside the annotated region, where TSan
// ignores memory accesses: conditions are not race-checked, everything else is.
//
// This file must not include absl/synchronization/*.h: it defines, under
// asm names, the very members those headers declare. Mutex, CondVar and
// Notification are therefore opaque pointers here.
//
// The mangled names carry abseil's inline namespace (Debian 12: "debian3");
// CMake reads it from absl/base/options.h, passes it as MLAKV_ABSL_NS
// ("7debian3", length-prefixed as the Itanium ABI mangles it) and checks at
// configure time that each symbol exists in libabsl_synchronization.so.

#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "absl/time/time.h"

#ifndef MLAKV_ABSL_NS
#error "MLAKV_ABSL_NS (abseil's mangled inline namespace) comes from cmake/tsan_sync.cmake"
#endif

// "_ZN4absl7debian3" "5Mutex4LockEv": absl::debian3::Mutex::Lock().
#define MLAKV_ABSL(suffix) "_ZN4absl" MLAKV_ABSL_NS suffix
#define MLAKV_ABSL_CONST(suffix) "_ZNK4absl" MLAKV_ABSL_NS suffix

// Declares `fn`, of type `type`, as the definition of `symbol`; MLAKV_NEXT(fn)
// is abseil's own definition of it.
#define MLAKV_INTERPOSE(fn, symbol, type)  \
  using fn##_type = type;                  \
  constexpr char fn##_symbol[] = symbol;   \
  extern "C" fn##_type fn __asm__(symbol);
#define MLAKV_NEXT(fn) \
  ([] { static fn##_type* const next = reinterpret_cast<fn##_type*>(NextDefinition(fn##_symbol)); return next; }())

namespace {

using absl::Duration;
using absl::Time;

// abseil's definition of `symbol`: the next one after this executable's.
void* NextDefinition(const char* symbol) {
  void* f = dlsym(RTLD_NEXT, symbol);
  if (f == nullptr) {
    std::fprintf(stderr, "tsan_absl_sync: no definition of %s after the executable's (%s)\n", symbol, dlerror());
    std::abort();
  }
  return f;
}

// Whether this thread holds each mutex shared: Await and CondVar::Wait
// release and retake the mutex in the mode it is held in, and TSan must be
// told the same mode. A small fixed table (no allocation, no thread-exit
// destructor); past kMaxHeld nested locks on one thread a mutex is taken as
// held exclusively, which TSan itself flags if wrong ("read unlock of a
// write locked mutex").
constexpr int kMaxHeld = 32;
struct Held {
  const void* mu;
  bool shared;
};
thread_local Held held[kMaxHeld];
thread_local int held_count = 0;

void NoteLocked(const void* mu, bool shared) {
  if (held_count < kMaxHeld) held[held_count++] = {mu, shared};
}
void NoteUnlocked(const void* mu) {
  for (int i = held_count - 1; i >= 0; --i) {
    if (held[i].mu == mu) {
      held[i] = held[--held_count];
      return;
    }
  }
}
unsigned HeldFlags(const void* mu) {
  for (int i = held_count - 1; i >= 0; --i) {
    if (held[i].mu == mu) return held[i].shared ? __tsan_mutex_read_lock : 0;
  }
  return 0;
}

// abseil calls some of these functions from others (CondVar::WaitWithTimeout
// calls WaitWithDeadline, Notification's waits call LockWhen*), and those
// calls bind here too. Only the outermost call is annotated; the nested ones
// go straight to abseil.
thread_local int depth = 0;
struct Outermost {
  const bool outermost = depth++ == 0;
  ~Outermost() { --depth; }
};

// A blocking lock in `flags` mode: `lock` returns once the mutex is held.
template <typename F>
auto AnnotatedLock(void* mu, unsigned flags, F&& lock) {
  const Outermost call;
  if (!call.outermost) return lock();
  __tsan_mutex_pre_lock(mu, flags);
  auto result = lock();
  __tsan_mutex_post_lock(mu, flags, 0);
  NoteLocked(mu, flags & __tsan_mutex_read_lock);
  return result;
}

void AnnotatedUnlock(void* mu, unsigned flags, void (*unlock)(void*)) {
  const Outermost call;
  if (!call.outermost) return unlock(mu);
  NoteUnlocked(mu);
  __tsan_mutex_pre_unlock(mu, flags);
  unlock(mu);
  __tsan_mutex_post_unlock(mu, flags);
}

// Await / CondVar::Wait: abseil releases the held mutex, waits, and retakes
// it before returning (also on timeout). TSan sees a release at the start
// and an acquire at the end, in the mode the mutex is held in.
template <typename F>
auto AnnotatedWait(void* mu, F&& wait) {
  const Outermost call;
  if (!call.outermost) return wait();
  const unsigned flags = HeldFlags(mu);
  NoteUnlocked(mu);
  __tsan_mutex_pre_unlock(mu, flags);
  __tsan_mutex_post_unlock(mu, flags);
  __tsan_mutex_pre_lock(mu, flags);
  auto result = wait();
  __tsan_mutex_post_lock(mu, flags, 0);
  NoteLocked(mu, flags & __tsan_mutex_read_lock);
  return result;
}

// Release on `addr` before, or acquire on it after, an outermost call.
template <typename F>
auto Releasing(void* addr, F&& call) {
  const Outermost outer;
  if (outer.outermost) __tsan_release(addr);
  return call();
}
template <typename F>
auto AcquiringIf(void* addr, F&& call) {
  const Outermost outer;
  auto result = call();
  if (outer.outermost && result) __tsan_acquire(addr);
  return result;
}

// Notification {Mutex mutex_; std::atomic<bool> notified_yet_;}: Notify()
// happens-before every wait that returns true and every HasBeenNotified()
// that reads true. HasBeenNotified is inline in the header (an instrumented
// acquire load of notified_yet_), so Notify releases on that address.
// tests/common/tsan_absl_sync_test.cc checks the layout.
void* NotifiedYet(void* notification) { return static_cast<char*>(notification) + sizeof(intptr_t); }

}  // namespace

// ---- absl::Mutex
MLAKV_INTERPOSE(MutexLock, MLAKV_ABSL("5Mutex4LockEv"), void(void*))
void MutexLock(void* mu) {
  AnnotatedLock(mu, 0, [&] { return (MLAKV_NEXT(MutexLock)(mu), 0); });
}

MLAKV_INTERPOSE(MutexReaderLock, MLAKV_ABSL("5Mutex10ReaderLockEv"), void(void*))
void MutexReaderLock(void* mu) {
  AnnotatedLock(mu, __tsan_mutex_read_lock, [&] { return (MLAKV_NEXT(MutexReaderLock)(mu), 0); });
}

MLAKV_INTERPOSE(MutexUnlock, MLAKV_ABSL("5Mutex6UnlockEv"), void(void*))
void MutexUnlock(void* mu) { AnnotatedUnlock(mu, 0, MLAKV_NEXT(MutexUnlock)); }

MLAKV_INTERPOSE(MutexReaderUnlock, MLAKV_ABSL("5Mutex12ReaderUnlockEv"), void(void*))
void MutexReaderUnlock(void* mu) { AnnotatedUnlock(mu, __tsan_mutex_read_lock, MLAKV_NEXT(MutexReaderUnlock)); }

MLAKV_INTERPOSE(MutexTryLock, MLAKV_ABSL("5Mutex7TryLockEv"), bool(void*))
bool MutexTryLock(void* mu) {
  const Outermost call;
  if (!call.outermost) return MLAKV_NEXT(MutexTryLock)(mu);
  __tsan_mutex_pre_lock(mu, __tsan_mutex_try_lock);
  const bool locked = MLAKV_NEXT(MutexTryLock)(mu);
  __tsan_mutex_post_lock(mu, __tsan_mutex_try_lock | (locked ? 0 : __tsan_mutex_try_lock_failed), 0);
  if (locked) NoteLocked(mu, false);
  return locked;
}

MLAKV_INTERPOSE(MutexReaderTryLock, MLAKV_ABSL("5Mutex13ReaderTryLockEv"), bool(void*))
bool MutexReaderTryLock(void* mu) {
  const Outermost call;
  if (!call.outermost) return MLAKV_NEXT(MutexReaderTryLock)(mu);
  __tsan_mutex_pre_lock(mu, __tsan_mutex_try_read_lock);
  const bool locked = MLAKV_NEXT(MutexReaderTryLock)(mu);
  __tsan_mutex_post_lock(mu, locked ? __tsan_mutex_try_read_lock : __tsan_mutex_try_read_lock_failed, 0);
  if (locked) NoteLocked(mu, true);
  return locked;
}

// The Condition is passed by reference (a pointer); this file never reads it.
MLAKV_INTERPOSE(MutexLockWhen, MLAKV_ABSL("5Mutex8LockWhenERKNS0_9ConditionE"), void(void*, const void*))
void MutexLockWhen(void* mu, const void* c) {
  AnnotatedLock(mu, 0, [&] { return (MLAKV_NEXT(MutexLockWhen)(mu, c), 0); });
}

MLAKV_INTERPOSE(MutexReaderLockWhen, MLAKV_ABSL("5Mutex14ReaderLockWhenERKNS0_9ConditionE"), void(void*, const void*))
void MutexReaderLockWhen(void* mu, const void* c) {
  AnnotatedLock(mu, __tsan_mutex_read_lock, [&] { return (MLAKV_NEXT(MutexReaderLockWhen)(mu, c), 0); });
}

// The *WithTimeout / *WithDeadline lock forms hold the mutex on return,
// whatever they return.
MLAKV_INTERPOSE(MutexLockWhenWithTimeout, MLAKV_ABSL("5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE"),
                bool(void*, const void*, Duration))
bool MutexLockWhenWithTimeout(void* mu, const void* c, Duration t) {
  return AnnotatedLock(mu, 0, [&] { return MLAKV_NEXT(MutexLockWhenWithTimeout)(mu, c, t); });
}

MLAKV_INTERPOSE(MutexLockWhenWithDeadline, MLAKV_ABSL("5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE"),
                bool(void*, const void*, Time))
bool MutexLockWhenWithDeadline(void* mu, const void* c, Time d) {
  return AnnotatedLock(mu, 0, [&] { return MLAKV_NEXT(MutexLockWhenWithDeadline)(mu, c, d); });
}

MLAKV_INTERPOSE(MutexAwait, MLAKV_ABSL("5Mutex5AwaitERKNS0_9ConditionE"), void(void*, const void*))
void MutexAwait(void* mu, const void* c) {
  AnnotatedWait(mu, [&] { return (MLAKV_NEXT(MutexAwait)(mu, c), 0); });
}

MLAKV_INTERPOSE(MutexAwaitWithTimeout, MLAKV_ABSL("5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE"),
                bool(void*, const void*, Duration))
bool MutexAwaitWithTimeout(void* mu, const void* c, Duration t) {
  return AnnotatedWait(mu, [&] { return MLAKV_NEXT(MutexAwaitWithTimeout)(mu, c, t); });
}

MLAKV_INTERPOSE(MutexAwaitWithDeadline, MLAKV_ABSL("5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE"),
                bool(void*, const void*, Time))
bool MutexAwaitWithDeadline(void* mu, const void* c, Time d) {
  return AnnotatedWait(mu, [&] { return MLAKV_NEXT(MutexAwaitWithDeadline)(mu, c, d); });
}

// A destroyed mutex's TSan state must go with it: a new mutex at the same
// address (stack, reused heap) would otherwise inherit its clock and owner.
MLAKV_INTERPOSE(MutexDestroyComplete, MLAKV_ABSL("5MutexD1Ev"), void(void*))
void MutexDestroyComplete(void* mu) {
  __tsan_mutex_destroy(mu, __tsan_mutex_not_static);
  MLAKV_NEXT(MutexDestroyComplete)(mu);
}
MLAKV_INTERPOSE(MutexDestroyBase, MLAKV_ABSL("5MutexD2Ev"), void(void*))
void MutexDestroyBase(void* mu) {
  __tsan_mutex_destroy(mu, __tsan_mutex_not_static);
  MLAKV_NEXT(MutexDestroyBase)(mu);
}

// ---- absl::CondVar: Wait* release and retake the mutex like Await.
MLAKV_INTERPOSE(CondVarWait, MLAKV_ABSL("7CondVar4WaitEPNS0_5MutexE"), void(void*, void*))
void CondVarWait(void* cv, void* mu) {
  AnnotatedWait(mu, [&] { return (MLAKV_NEXT(CondVarWait)(cv, mu), 0); });
}

MLAKV_INTERPOSE(CondVarWaitWithTimeout, MLAKV_ABSL("7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE"),
                bool(void*, void*, Duration))
bool CondVarWaitWithTimeout(void* cv, void* mu, Duration t) {
  return AnnotatedWait(mu, [&] { return MLAKV_NEXT(CondVarWaitWithTimeout)(cv, mu, t); });
}

MLAKV_INTERPOSE(CondVarWaitWithDeadline, MLAKV_ABSL("7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE"),
                bool(void*, void*, Time))
bool CondVarWaitWithDeadline(void* cv, void* mu, Time d) {
  return AnnotatedWait(mu, [&] { return MLAKV_NEXT(CondVarWaitWithDeadline)(cv, mu, d); });
}

// ---- absl::Notification
MLAKV_INTERPOSE(NotificationNotify, MLAKV_ABSL("12Notification6NotifyEv"), void(void*))
void NotificationNotify(void* n) {
  Releasing(NotifiedYet(n), [&] { return (MLAKV_NEXT(NotificationNotify)(n), 0); });
}

MLAKV_INTERPOSE(NotificationWait, MLAKV_ABSL_CONST("12Notification19WaitForNotificationEv"), void(void*))
void NotificationWait(void* n) {
  AcquiringIf(NotifiedYet(n), [&] { return (MLAKV_NEXT(NotificationWait)(n), true); });
}

MLAKV_INTERPOSE(NotificationWaitWithTimeout,
                MLAKV_ABSL_CONST("12Notification30WaitForNotificationWithTimeoutENS0_8DurationE"),
                bool(void*, Duration))
bool NotificationWaitWithTimeout(void* n, Duration t) {
  return AcquiringIf(NotifiedYet(n), [&] { return MLAKV_NEXT(NotificationWaitWithTimeout)(n, t); });
}

MLAKV_INTERPOSE(NotificationWaitWithDeadline,
                MLAKV_ABSL_CONST("12Notification31WaitForNotificationWithDeadlineENS0_4TimeE"),
                bool(void*, Time))
bool NotificationWaitWithDeadline(void* n, Time d) {
  return AcquiringIf(NotifiedYet(n), [&] { return MLAKV_NEXT(NotificationWaitWithDeadline)(n, d); });
}
