// WorkloadOps: the ordinary operations of a soak client, each checked
// against the client's models as it completes: appends (hand-built streams
// and the C++ client's own Append), AppendBatch, read-backs, frees,
// truncations, and the NOT_FOUND answers for sequences that do not exist.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "tests/soak/client_session.h"

namespace mlakv::soak {

class WorkloadOps {
 public:
  explicit WorkloadOps(ClientSession& session) : s_(session) {}

  // One operation picked at random by weight. `name` says which ran;
  // `touched` the slots it used (resynced when it reports a violation).
  absl::Status RunOne(std::string* name, std::vector<Slot*>* touched);
  // Frees every sequence of the session, checking pages_freed (end of run).
  void FreeAll();

 private:
  absl::Status Append(Slot& slot, AppendShape shape);
  absl::Status AppendLib(Slot& slot);
  absl::Status Batch(std::vector<Slot*>* touched);
  absl::Status Read(Slot& slot);
  absl::Status Free(Slot& slot);
  absl::Status Truncate(Slot& slot);
  absl::Status TruncateBeyond(Slot& slot);
  absl::Status Missing(Slot& slot);
  absl::Status EmptyAppend(Slot& slot);
  // One Append stream of `plan` that must commit.
  absl::Status Commit(Slot& slot, const StreamPlan& plan);

  ClientSession& s_;
};

}  // namespace mlakv::soak
