#include "server/regions/mapping_fault_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace mlakv::server {
namespace {

// Read by the signal handler: plain atomics only (lock-free on x86-64), no
// allocation. A slot is live when `end` is non-zero.
struct Range {
  // A seqlock around begin/end: odd while Register or the destructor
  // changes them, so that the handler never pairs one range's begin with
  // another's end (or with 0: [0, end) would cover every address below).
  std::atomic<uint64_t> version{0};
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
  std::atomic<uint64_t> faults{0};
  std::atomic<bool> taken{false};
};
static_assert(std::atomic<uintptr_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "the SIGBUS handler reads these atomics; they must be lock-free");

Range g_ranges[MappingFaultGuard::kMaxRanges];
struct sigaction g_previous;
uintptr_t g_page_mask = 0;

// The range in r, or false when the slot is empty. Async-signal-safe: a
// writer on another thread finishes in a few instructions; the faulting
// thread itself is never inside one (it faulted reading a mapping).
bool ReadRange(const Range& r, uintptr_t* begin, uintptr_t* end) {
  for (;;) {
    const uint64_t v = r.version.load();
    if ((v & 1) != 0) continue;
    *begin = r.begin.load();
    *end = r.end.load();
    if (r.version.load() == v) return *end != 0;
  }
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  // si_code <= 0: sent (kill, sigqueue, tgkill), not a fault; its si_addr
  // is the sender's pid and uid, never an address to repair.
  const bool fault = info->si_code > 0;
  for (Range& r : g_ranges) {
    if (!fault) break;
    uintptr_t begin, end;
    if (!ReadRange(r, &begin, &end)) continue;
    if (addr < begin || addr >= end) continue;
    const uintptr_t page = addr & g_page_mask;
    void* zeros = mmap(reinterpret_cast<void*>(page), end - page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                       -1, 0);
    if (zeros == MAP_FAILED) break;  // cannot repair: treat as not ours
    r.faults.fetch_add(1, std::memory_order_relaxed);
    return;  // the read resumes, on zeros
  }
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN && g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
    return;
  }
  // Not a guarded mapping: default action. The faulting instruction runs
  // again on return and the process dies of SIGBUS, as it would have; a
  // sent SIGBUS is sent again (pending until this handler returns), or it
  // would be absorbed once and leave the guard uninstalled for good.
  signal(SIGBUS, SIG_DFL);
  if (!fault) raise(SIGBUS);
}

absl::Status InstallOnce() {
  static std::once_flag once;
  static int error = 0;
  std::call_once(once, [] {
    g_page_mask = ~(static_cast<uintptr_t>(sysconf(_SC_PAGESIZE)) - 1);
    struct sigaction action;
    std::memset(&action, 0, sizeof(action));
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &g_previous) != 0) error = errno;
  });
  if (error != 0) return absl::InternalError(absl::StrCat("sigaction(SIGBUS): ", std::strerror(error)));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<MappingFaultGuard>> MappingFaultGuard::Register(const void* base, size_t bytes) {
  MLAKV_RETURN_IF_ERROR(InstallOnce());
  if (bytes == 0) return absl::InvalidArgumentError("MappingFaultGuard: empty range");
  for (int i = 0; i < kMaxRanges; ++i) {
    bool expected = false;
    if (!g_ranges[i].taken.compare_exchange_strong(expected, true)) continue;
    g_ranges[i].faults.store(0, std::memory_order_relaxed);
    g_ranges[i].version.fetch_add(1);  // odd: changing
    g_ranges[i].begin.store(reinterpret_cast<uintptr_t>(base));
    g_ranges[i].end.store(reinterpret_cast<uintptr_t>(base) + bytes);
    g_ranges[i].version.fetch_add(1);
    return std::unique_ptr<MappingFaultGuard>(new MappingFaultGuard(i));
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("more than ", kMaxRanges, " shared-memory mappings are guarded at once"));
}

MappingFaultGuard::~MappingFaultGuard() {
  g_ranges[slot_].version.fetch_add(1);  // odd: changing
  g_ranges[slot_].end.store(0);
  g_ranges[slot_].begin.store(0);
  g_ranges[slot_].version.fetch_add(1);
  g_ranges[slot_].taken.store(false, std::memory_order_release);
}

uint64_t MappingFaultGuard::faults() const { return g_ranges[slot_].faults.load(std::memory_order_acquire); }

}  // namespace mlakv::server
