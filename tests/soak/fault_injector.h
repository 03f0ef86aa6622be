// FaultInjector: the faults a soak client injects, each followed by a check
// that the affected sequences are exactly as the protocol says
// (docs/server.md "Atomicity", "Errors"):
//
//  * streams the client ends itself before its half-close (cancel,
//    deadline, a severed connection, a dropped channel) can never commit:
//    once the server has let go of the sequence (ClientSession::Settle) it
//    must be unchanged; an OK status is a violation;
//  * streams that race their half-close with a cancel or a deadline (and an
//    AppendBatch with a deadline too short) may commit or not: the sequence
//    must then be exactly the state before or the state after (for a batch,
//    all its sequences the same way), and the model takes what committed;
//  * a stream held open while other calls name its sequence must make them
//    fail with ABORTED, show no new length, and then commit;
//  * streams and batches the server must refuse (a message that does not
//    parse, one over max_message_bytes, an idle stream, expect_length,
//    a hole, other scales, malformed messages, a bad batch entry) must fail
//    with the documented code, and since the server sends that status only
//    after the rollback, the sequence must be unchanged at once.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tests/soak/client_session.h"

namespace mlakv::soak {

class FaultInjector {
 public:
  explicit FaultInjector(ClientSession& session) : s_(session) {}

  // One fault picked at random by weight; `name` says which, `touched` the
  // slots it used (resynced when it reports a violation).
  absl::Status RunOne(std::string* name, std::vector<Slot*>* touched);

 private:
  // Ended by the client.
  absl::Status CancelMidStream(Slot& slot);
  absl::Status CancelRace(Slot& slot);
  absl::Status DeadlineMidStream(Slot& slot);
  absl::Status DeadlineRace(Slot& slot);
  absl::Status DisconnectCut(Slot& slot);
  absl::Status DisconnectDrop(Slot& slot);
  absl::Status BatchDeadlineRace(std::vector<Slot*>* touched);
  // A stream held open while other calls name its sequence: they are
  // ABORTED (Free/Truncate of a sequence not yet visible: NOT_FOUND), no
  // length moves before the commit, and the stream then commits.
  absl::Status BusySequence(Slot& slot);
  // While the stream is open: a new sequence is invisible; an existing one
  // shows its committed lengths, and between its pages before and after.
  absl::Status CheckDuringAppend(const Slot& slot, const std::optional<SequenceModel>& after);
  // Refused by the server.
  absl::Status ParseTruncated(Slot& slot);
  absl::Status ParseBadUtf8(Slot& slot);
  absl::Status Oversize(Slot& slot);
  absl::Status IdleStream(Slot& slot);
  absl::Status ExpectLengthMismatch(Slot& slot);
  absl::Status Hole(Slot& slot);
  absl::Status ScaleMismatch(Slot& slot);
  absl::Status InvalidMessage(Slot& slot);
  absl::Status BatchBadEntry(std::vector<Slot*>* touched);

  // A valid stream of at least `min_messages` messages for the slot, or
  // nullopt when none fits (the fault is skipped).
  absl::StatusOr<std::optional<StreamPlan>> PlanFor(Slot& slot, int min_messages, int max_messages = 4);
  // A message index >= `first` whose message writes rows, or -1.
  int MessageWithRows(const StreamPlan& plan, int first);

  // The stream was ended by the client before its half-close.
  absl::Status ExpectRolledBack(Slot& slot, const grpc::Status& status, absl::string_view kind);
  // The server had to refuse with `code`; nothing changed, at once.
  absl::Status ExpectRefused(Slot& slot, const grpc::Status& status, grpc::StatusCode code, absl::string_view kind);
  // A race: committed (the model takes `after`) or not; `allowed` is the
  // code a lost race may end with.
  absl::Status ExpectEither(Slot& slot, const grpc::Status& status, grpc::StatusCode allowed, const StreamPlan& plan,
                            const std::optional<SequenceModel>& after, const v1::AppendResponse& response,
                            absl::string_view kind);

  ClientSession& s_;
};

}  // namespace mlakv::soak
