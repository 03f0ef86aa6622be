// MappingFaultGuard: a producer that shrinks its shared-memory object while
// the server reads it must not be able to kill the server.
//
// Reading a page of a MAP_SHARED mapping that lies past the end of its file
// raises SIGBUS, whichever thread reads it (the pool's worker, the CPU
// quantizer's threads, the staging copier's helpers). The guard installs one
// process-wide SIGBUS handler. When the faulting address lies in a
// registered range, the handler maps anonymous zero pages over the rest of
// that range (mmap MAP_FIXED from the faulting page to the range's end) and
// returns: the interrupted read continues on zeros, and the range's fault
// count goes up. The reader then sees faulted() and fails the append (the
// rows it read were the producer's garbage, never the server's memory); the
// range stays poisoned, since its pages no longer follow the object.
// A SIGBUS anywhere else goes to the previous handler, or kills the process
// as before (the handler restores the default action and returns, so the
// faulting instruction faults again).
//
// Cost on the read path: none (no copy, no per-read setjmp); one atomic load
// per append to look at the fault count (docs/reliability.md "Regions").
// mmap is a plain system call on Linux (glibc takes no lock in it), which is
// what makes calling it from the handler sound here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace mlakv::server {

class MappingFaultGuard {
 public:
  // At most this many ranges at once (RESOURCE_EXHAUSTED beyond).
  static constexpr int kMaxRanges = 4096;

  // Registers [base, base + bytes) (a mapping of this process) with the
  // handler, installing it on first use; unregistered by the destructor,
  // which must run before the mapping is unmapped.
  static absl::StatusOr<std::unique_ptr<MappingFaultGuard>> Register(const void* base, size_t bytes);
  ~MappingFaultGuard();
  MappingFaultGuard(const MappingFaultGuard&) = delete;
  MappingFaultGuard& operator=(const MappingFaultGuard&) = delete;

  // Faults the handler absorbed in this range since registration.
  uint64_t faults() const;
  bool faulted() const { return faults() != 0; }

 private:
  explicit MappingFaultGuard(int slot) : slot_(slot) {}
  const int slot_;
};

}  // namespace mlakv::server
