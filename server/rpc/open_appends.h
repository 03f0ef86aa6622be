// OpenAppends: the open Append streams whose first message named a
// commit_token, by token, for CommitAppend (docs/server.md "Committing an
// Append stream by a unary call").
//
// Locking: the registry's mutex is taken before a stream's own, never
// after (as the StreamWatchdog's): Take runs its claim on the stream under
// the registry's mutex, and a stream removes itself (in AppendReactor::Done,
// holding none of its own locks) before it finishes -- so a stream that
// Take found cannot end while the claim runs.
#pragma once

#include <cstddef>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace mlakv::server {

class AppendReactor;

// The longest commit_token accepted (a client's UUID is 32-36 bytes).
inline constexpr size_t kMaxCommitTokenBytes = 128;

class OpenAppends {
 public:
  // ALREADY_EXISTS when another open stream holds `token`.
  absl::Status Add(const std::string& token, AppendReactor* stream);
  // Removes `token` if `stream` holds it (Take may have removed it already).
  void Remove(const std::string& token, const AppendReactor* stream);
  // Removes the stream holding `token` and runs `claim` on it, under the
  // registry's mutex; false when no open stream holds it.
  bool Take(const std::string& token, absl::FunctionRef<void(AppendReactor*)> claim);
  size_t size() const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, AppendReactor*> streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mlakv::server
