// ClientSession: everything one soak client thread owns — its connections,
// its random stream, and its slots: the sequence ids it alone uses, each
// with the model of what the server must hold for it — plus the checks
// every operation and fault shares.
//
// Two connections: `client` (the C++ client library: unary calls, reads,
// the library's own Append) and `channel`/`stub` (hand-built streams, raw
// streams, faults, and the probes that settle a sequence after a fault on
// that same connection).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/kv_cache_client.h"
#include "grpcpp/channel.h"
#include "tests/soak/append_planner.h"
#include "tests/soak/row_factory.h"
#include "tests/soak/sequence_model.h"
#include "tests/soak/sequence_verifier.h"
#include "tests/soak/soak_options.h"
#include "tests/soak/soak_report.h"

namespace mlakv::soak {

struct Slot {
  std::string id;
  std::optional<SequenceModel> model;  // nullopt: the sequence must not exist
  // When this client last ended a stream of this sequence itself (cancel,
  // deadline, disconnect): until the server has seen that, it may still hold
  // the sequence (ABORTED for the next append), which is no broken promise.
  absl::Time client_ended = absl::InfinitePast();
};

// An AppendBatch over several of the session's slots, with what each
// sequence is before and must be after it commits.
struct BatchPlan {
  v1::AppendBatchRequest request;
  v1::SequenceView view = v1::SEQUENCE_VIEW_FULL;
  std::vector<Slot*> slots;
  std::vector<StreamPlan> plans;
  std::vector<std::optional<SequenceModel>> before;
  std::vector<std::optional<SequenceModel>> after;
};

class ClientSession {
 public:
  static absl::StatusOr<std::unique_ptr<ClientSession>> Create(int index, const std::string& target,
                                                               const SoakOptions& options,
                                                               const PoolGeometry& geometry, SoakReport* report);

  int index() const { return index_; }
  const SoakOptions& options() const { return options_; }
  const PoolGeometry& geometry() const { return geometry_; }
  const std::string& target() const { return target_; }
  SoakReport& report() { return *report_; }
  std::mt19937_64& rng() { return rng_; }
  KvCacheClient& client() { return *client_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  v1::KvCache::Stub& stub() { return *stub_; }
  const AppendPlanner& planner() const { return planner_; }
  const SequenceVerifier& verifier() const { return verifier_; }
  std::vector<Slot>& slots() { return slots_; }
  const std::vector<Slot>& slots() const { return slots_; }

  // Random helpers.
  bool Chance(double p);
  uint32_t Uniform(uint32_t lo, uint32_t hi);  // [lo, hi]
  Slot& AnySlot();
  // A deadline for a call that races its own commit: log-uniform over
  // 20 us .. 10 ms, so that some calls end before, some after the commit.
  absl::Duration RaceDeadline();
  Slot* ExistingSlot();  // nullptr when the client holds no sequence
  Slot* EmptySlot();     // nullptr when every slot holds one

  // An AppendBatch of 2..max_entries of this session's sequences (fewer
  // when some have no room); empty plans when none has.
  absl::StatusOr<BatchPlan> PlanBatch(uint32_t max_entries);

  // A context whose deadline is `timeout` from now (default: call_timeout).
  std::unique_ptr<grpc::ClientContext> Context(std::optional<absl::Duration> timeout = std::nullopt) const;
  // A new channel of its own connection to `target`.
  static std::shared_ptr<grpc::Channel> NewChannel(const std::string& target);

  // One Append stream of `requests` on `stub` (the messages in order, the
  // last carrying the half-close).
  grpc::Status AppendStream(const std::vector<v1::AppendRequest>& requests, v1::AppendResponse* response,
                            std::optional<absl::Duration> timeout = std::nullopt);
  // Runs `call` again while it fails with ABORTED and one of `slots` may
  // still be held by a stream this client ended itself (up to 5 s).
  grpc::Status RetryAborted(const std::vector<const Slot*>& slots, const std::function<grpc::Status()>& call);
  absl::Status RetryAborted(const std::vector<const Slot*>& slots, const std::function<absl::Status()>& call);

  // After a stream this client ended itself: waits until the server holds
  // the sequence no more (a zero-row Append probe on `stub`'s connection is
  // refused with ABORTED while another append holds it) and probes agree
  // for options().settle_quiet. A violation when it stays held.
  absl::Status Settle(Slot& slot);
  // Frees the sequence on the server and forgets its model (after a
  // violation, so that one broken promise is reported once).
  void Resync(Slot& slot);

  // The response of an append that committed `plan`, taking the sequence
  // from `before` to `after`: rows, pages allocated, and the sequence in the
  // view the plan asked for.
  absl::Status CheckAppendResponse(const v1::AppendResponse& response, const StreamPlan& plan,
                                   const std::optional<SequenceModel>& before,
                                   const std::optional<SequenceModel>& after) const;
  // The same for an AppendBatch of `plans` (one per entry, in order).
  absl::Status CheckBatchResponse(const v1::AppendBatchResponse& response, v1::SequenceView view,
                                  const std::vector<StreamPlan>& plans,
                                  const std::vector<std::optional<SequenceModel>>& before,
                                  const std::vector<std::optional<SequenceModel>>& after) const;
  // The server committed: the slot's model becomes `after`.
  void Adopt(Slot& slot, const StreamPlan& plan, std::optional<SequenceModel> after);

  // OK when `status` has `code` (a status describing the violation otherwise).
  static absl::Status ExpectCode(const grpc::Status& status, grpc::StatusCode code, absl::string_view what);

 private:
  ClientSession(int index, std::string target, const SoakOptions& options, const PoolGeometry& geometry,
                SoakReport* report, std::unique_ptr<KvCacheClient> client);

  const int index_;
  const std::string target_;
  const SoakOptions& options_;
  const PoolGeometry& geometry_;
  SoakReport* report_;
  std::mt19937_64 rng_;
  std::unique_ptr<KvCacheClient> client_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  RowFactory rows_;
  AppendPlanner planner_;
  SequenceVerifier verifier_;
  std::vector<Slot> slots_;
};

}  // namespace mlakv::soak
