#include "tests/soak/fault_injector.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "tests/soak/raw_append_call.h"
#include "tests/soak/tcp_cut_proxy.h"

namespace mlakv::soak {
namespace {

std::string CodeName(grpc::StatusCode code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

void SleepMs(uint32_t ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

std::vector<std::string> Serialize(const std::vector<v1::AppendRequest>& requests) {
  std::vector<std::string> out;
  for (const v1::AppendRequest& r : requests) out.push_back(r.SerializeAsString());
  return out;
}

// Working lengths (committed, or staged by an earlier message of the
// stream) of every layer just before message `k` of `plan`.
std::vector<uint32_t> LengthsBefore(const std::optional<SequenceModel>& model, const StreamPlan& plan, int k,
                                    int num_layers) {
  std::vector<uint32_t> have(num_layers, 0);
  if (model) {
    for (int l = 0; l < num_layers; ++l) have[l] = model->layer_length(l);
  }
  for (int i = 0; i < k; ++i) {
    const PlannedMessage& m = plan.messages[i];
    for (const PlannedLayer& l : m.layers) have[l.rows.layer] = std::max(have[l.rows.layer], m.start + m.rows);
  }
  return have;
}

struct Weighted {
  const char* name;
  int weight;
};
constexpr Weighted kFaults[] = {
    {"cancel_mid_stream", 2},   {"cancel_race", 2},     {"deadline_mid_stream", 2}, {"deadline_race", 2},
    {"disconnect_cut", 2},      {"disconnect_drop", 2}, {"batch_deadline_race", 2}, {"parse_truncated", 2},
    {"parse_bad_utf8", 1},      {"oversize_message", 1}, {"idle_stream", 1},        {"expect_length_mismatch", 2},
    {"hole", 2},                {"scale_mismatch", 1},  {"invalid_message", 2},     {"batch_bad_entry", 2},
    {"busy_sequence", 2},
};

}  // namespace

absl::Status FaultInjector::RunOne(std::string* name, std::vector<Slot*>* touched) {
  int total = 0;
  for (const Weighted& w : kFaults) total += w.weight;
  int pick = static_cast<int>(s_.Uniform(0, total - 1));
  std::string kind;
  for (const Weighted& w : kFaults) {
    if (pick < w.weight) {
      kind = w.name;
      break;
    }
    pick -= w.weight;
  }
  *name = kind;
  s_.report().CountFault(kind);
  if (kind == "batch_deadline_race") return BatchDeadlineRace(touched);
  if (kind == "batch_bad_entry") return BatchBadEntry(touched);
  Slot& slot = s_.AnySlot();
  touched->push_back(&slot);
  if (kind == "cancel_mid_stream") return CancelMidStream(slot);
  if (kind == "cancel_race") return CancelRace(slot);
  if (kind == "deadline_mid_stream") return DeadlineMidStream(slot);
  if (kind == "deadline_race") return DeadlineRace(slot);
  if (kind == "disconnect_cut") return DisconnectCut(slot);
  if (kind == "disconnect_drop") return DisconnectDrop(slot);
  if (kind == "parse_truncated") return ParseTruncated(slot);
  if (kind == "parse_bad_utf8") return ParseBadUtf8(slot);
  if (kind == "oversize_message") return Oversize(slot);
  if (kind == "idle_stream") return IdleStream(slot);
  if (kind == "expect_length_mismatch") return ExpectLengthMismatch(slot);
  if (kind == "hole") return Hole(slot);
  if (kind == "scale_mismatch") return ScaleMismatch(slot);
  if (kind == "busy_sequence") return BusySequence(slot);
  return InvalidMessage(slot);
}

// ---- shared checks ----------------------------------------------------------------

absl::StatusOr<std::optional<StreamPlan>> FaultInjector::PlanFor(Slot& slot, int min_messages, int max_messages) {
  for (int attempt = 0; attempt < 4; ++attempt) {
    MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan,
                           s_.planner().PlanStream(s_.rng(), slot.id, slot.model,
                                                   {.min_messages = min_messages, .max_messages = max_messages}));
    if (plan && static_cast<int>(plan->messages.size()) >= min_messages && MessageWithRows(*plan, 0) >= 0) {
      return plan;
    }
  }
  s_.report().CountOutcome("skipped", "no_plan_fits");
  return std::nullopt;
}

int FaultInjector::MessageWithRows(const StreamPlan& plan, int first) {
  std::vector<int> found;
  for (int i = first; i < static_cast<int>(plan.messages.size()); ++i) {
    if (plan.messages[i].rows > 0 && !plan.messages[i].layers.empty()) found.push_back(i);
  }
  return found.empty() ? -1 : found[s_.Uniform(0, static_cast<uint32_t>(found.size()) - 1)];
}

absl::Status FaultInjector::ExpectRolledBack(Slot& slot, const grpc::Status& status, absl::string_view kind) {
  if (status.ok()) {
    return Mismatch(absl::StrCat(kind, " of ", slot.id,
                                 ": the client ended the stream before its half-close, yet it returned OK"));
  }
  s_.report().CountOutcome(kind, CodeName(status.error_code()));
  MLAKV_RETURN_IF_ERROR(s_.Settle(slot));
  return WithContext(s_.verifier().Verify(slot.id, slot.model), absl::StrCat("after ", kind));
}

absl::Status FaultInjector::ExpectRefused(Slot& slot, const grpc::Status& status, grpc::StatusCode code,
                                          absl::string_view kind) {
  MLAKV_RETURN_IF_ERROR(ClientSession::ExpectCode(status, code, absl::StrCat(kind, " of ", slot.id)));
  return WithContext(s_.verifier().Verify(slot.id, slot.model),
                     absl::StrCat("right after ", kind, " was refused with ", CodeName(code)));
}

absl::Status FaultInjector::ExpectEither(Slot& slot, const grpc::Status& status, grpc::StatusCode allowed,
                                         const StreamPlan& plan, const std::optional<SequenceModel>& after,
                                         const v1::AppendResponse& response, absl::string_view kind) {
  if (status.ok()) {
    s_.report().CountOutcome(kind, "committed_ok");
    MLAKV_RETURN_IF_ERROR(s_.CheckAppendResponse(response, plan, slot.model, after));
    s_.Adopt(slot, plan, after);
    return WithContext(s_.verifier().Verify(slot.id, slot.model), absl::StrCat("after ", kind, " committed"));
  }
  MLAKV_RETURN_IF_ERROR(ClientSession::ExpectCode(status, allowed, absl::StrCat(kind, " of ", slot.id)));
  MLAKV_RETURN_IF_ERROR(s_.Settle(slot));
  MLAKV_ASSIGN_OR_RETURN(const int which, s_.verifier().WhichOf(slot.id, slot.model, after));
  if (which == 1) {
    s_.report().CountOutcome(kind, absl::StrCat("committed_despite_", CodeName(status.error_code())));
    s_.Adopt(slot, plan, after);
  } else {
    s_.report().CountOutcome(kind, "rolled_back");
  }
  return absl::OkStatus();
}

// ---- ended by the client ------------------------------------------------------------

absl::Status FaultInjector::CancelMidStream(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, PlanFor(slot, 2));
  if (!plan) return absl::OkStatus();
  const std::vector<v1::AppendRequest> requests = s_.planner().ToRequests(*plan);
  const size_t k = s_.Uniform(1, static_cast<uint32_t>(requests.size()) - 1);
  std::unique_ptr<grpc::ClientContext> context = s_.Context();
  v1::AppendResponse response;
  auto writer = s_.stub().Append(context.get(), &response);
  for (size_t i = 0; i < k && writer->Write(requests[i]); ++i) {
  }
  SleepMs(s_.Uniform(0, 20));  // let the server stage some of it
  context->TryCancel();
  return ExpectRolledBack(slot, writer->Finish(), "cancel_mid_stream");
}

absl::Status FaultInjector::CancelRace(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, PlanFor(slot, 1));
  if (!plan) return absl::OkStatus();
  const std::optional<SequenceModel> after = s_.planner().Apply(slot.model, *plan);
  const std::vector<v1::AppendRequest> requests = s_.planner().ToRequests(*plan);
  std::unique_ptr<grpc::ClientContext> context = s_.Context();
  v1::AppendResponse response;
  auto writer = s_.stub().Append(context.get(), &response);
  bool alive = true;
  for (size_t i = 0; i + 1 < requests.size() && alive; ++i) alive = writer->Write(requests[i]);
  if (alive) writer->Write(requests.back(), grpc::WriteOptions().set_last_message());  // carries the half-close
  if (s_.Chance(0.5)) std::this_thread::sleep_for(std::chrono::microseconds(s_.Uniform(0, 3000)));
  context->TryCancel();
  return ExpectEither(slot, writer->Finish(), grpc::StatusCode::CANCELLED, *plan, after, response, "cancel_race");
}

absl::Status FaultInjector::DeadlineMidStream(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, PlanFor(slot, 2));
  if (!plan) return absl::OkStatus();
  const std::vector<v1::AppendRequest> requests = s_.planner().ToRequests(*plan);
  const uint32_t deadline_ms = s_.Uniform(80, 200);
  std::unique_ptr<grpc::ClientContext> context = s_.Context(absl::Milliseconds(deadline_ms));
  v1::AppendResponse response;
  auto writer = s_.stub().Append(context.get(), &response);
  writer->Write(requests.front());
  SleepMs(deadline_ms + 50);  // the rest of the stream comes too late: no half-close before the deadline
  const grpc::Status status = writer->Finish();
  if (!status.ok()) {
    MLAKV_RETURN_IF_ERROR(ClientSession::ExpectCode(status, grpc::StatusCode::DEADLINE_EXCEEDED,
                                                    absl::StrCat("deadline_mid_stream of ", slot.id)));
  }
  return ExpectRolledBack(slot, status, "deadline_mid_stream");
}

absl::Status FaultInjector::DeadlineRace(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, PlanFor(slot, 1));
  if (!plan) return absl::OkStatus();
  const std::optional<SequenceModel> after = s_.planner().Apply(slot.model, *plan);
  const std::vector<v1::AppendRequest> requests = s_.planner().ToRequests(*plan);
  v1::AppendResponse response;
  const grpc::Status status = s_.AppendStream(requests, &response, s_.RaceDeadline());
  return ExpectEither(slot, status, grpc::StatusCode::DEADLINE_EXCEEDED, *plan, after, response, "deadline_race");
}

absl::Status FaultInjector::DisconnectCut(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, PlanFor(slot, 2));
  if (!plan) return absl::OkStatus();
  const std::vector<v1::AppendRequest> requests = s_.planner().ToRequests(*plan);
  MLAKV_ASSIGN_OR_RETURN(std::unique_ptr<TcpCutProxy> proxy, TcpCutProxy::Create(s_.target()));
  grpc::Status status;
  {
    std::shared_ptr<grpc::Channel> channel = ClientSession::NewChannel(proxy->target());
    std::unique_ptr<v1::KvCache::Stub> stub = v1::KvCache::NewStub(channel);
    std::unique_ptr<grpc::ClientContext> context = s_.Context();
    v1::AppendResponse response;
    auto writer = stub->Append(context.get(), &response);
    const size_t k = s_.Uniform(1, static_cast<uint32_t>(requests.size()) - 1);
    for (size_t i = 0; i < k && writer->Write(requests[i]); ++i) {
    }
    SleepMs(s_.Uniform(0, 20));
    proxy->Cut();  // RST on both sides, under the open stream
    status = writer->Finish();
  }
  return ExpectRolledBack(slot, status, "disconnect_cut");
}

absl::Status FaultInjector::DisconnectDrop(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, PlanFor(slot, 2));
  if (!plan) return absl::OkStatus();
  const std::vector<v1::AppendRequest> requests = s_.planner().ToRequests(*plan);
  {
    // A channel of its own, destroyed with the stream open: no Finish, the
    // call and its connection simply go away.
    std::shared_ptr<grpc::Channel> channel = ClientSession::NewChannel(s_.target());
    std::unique_ptr<v1::KvCache::Stub> stub = v1::KvCache::NewStub(channel);
    std::unique_ptr<grpc::ClientContext> context = s_.Context();
    v1::AppendResponse response;
    auto writer = stub->Append(context.get(), &response);
    const size_t k = s_.Uniform(1, static_cast<uint32_t>(requests.size()) - 1);
    for (size_t i = 0; i < k && writer->Write(requests[i]); ++i) {
    }
    SleepMs(s_.Uniform(0, 20));
    writer.reset();
    context.reset();
  }
  s_.report().CountOutcome("disconnect_drop", "dropped");
  MLAKV_RETURN_IF_ERROR(s_.Settle(slot));
  return WithContext(s_.verifier().Verify(slot.id, slot.model), "after disconnect_drop");
}

absl::Status FaultInjector::BatchDeadlineRace(std::vector<Slot*>* touched) {
  MLAKV_ASSIGN_OR_RETURN(BatchPlan batch, s_.PlanBatch(4));
  touched->insert(touched->end(), batch.slots.begin(), batch.slots.end());
  if (batch.plans.empty()) return absl::OkStatus();
  std::unique_ptr<grpc::ClientContext> context = s_.Context(s_.RaceDeadline());
  v1::AppendBatchResponse response;
  const grpc::Status status = s_.stub().AppendBatch(context.get(), batch.request, &response);
  if (status.ok()) {
    s_.report().CountOutcome("batch_deadline_race", "committed_ok");
    MLAKV_RETURN_IF_ERROR(s_.CheckBatchResponse(response, batch.view, batch.plans, batch.before, batch.after));
    for (size_t i = 0; i < batch.plans.size(); ++i) s_.Adopt(*batch.slots[i], batch.plans[i], batch.after[i]);
    return absl::OkStatus();
  }
  MLAKV_RETURN_IF_ERROR(ClientSession::ExpectCode(status, grpc::StatusCode::DEADLINE_EXCEEDED, "batch_deadline_race"));
  // All or nothing: every sequence of the batch before, or every one after.
  std::vector<int> which;
  for (size_t i = 0; i < batch.plans.size(); ++i) {
    MLAKV_RETURN_IF_ERROR(s_.Settle(*batch.slots[i]));
    MLAKV_ASSIGN_OR_RETURN(const int w, s_.verifier().WhichOf(batch.slots[i]->id, batch.before[i], batch.after[i]));
    which.push_back(w);
  }
  for (size_t i = 0; i < which.size(); ++i) {
    if (which[i] != which[0]) {
      return Mismatch(absl::StrCat("AppendBatch of ", which.size(), " sequences ended DEADLINE_EXCEEDED half applied: ",
                                   batch.slots[0]->id, " is ", which[0] ? "after" : "before", " but ",
                                   batch.slots[i]->id, " is ", which[i] ? "after" : "before"));
    }
  }
  s_.report().CountOutcome("batch_deadline_race", which[0] ? "committed_despite_DEADLINE_EXCEEDED" : "rolled_back");
  if (which[0] == 1) {
    for (size_t i = 0; i < batch.plans.size(); ++i) s_.Adopt(*batch.slots[i], batch.plans[i], batch.after[i]);
  }
  return absl::OkStatus();
}

absl::Status FaultInjector::CheckDuringAppend(const Slot& slot, const std::optional<SequenceModel>& after) {
  MLAKV_ASSIGN_OR_RETURN(ServerSequence server, s_.verifier().Fetch(slot.id, false));
  if (!slot.model) {
    if (!server.exists) return absl::OkStatus();
    return Mismatch(absl::StrCat("busy_sequence: ", slot.id, " is visible before the append creating it committed"));
  }
  if (!server.exists) return Mismatch(absl::StrCat("busy_sequence: ", slot.id, " vanished during an append"));
  // The pages the append took so far are visible, its lengths are not.
  std::vector<std::string> diffs;
  const v1::Sequence& meta = server.meta;
  for (int l = 0; l < meta.layer_lengths_size() && l < slot.model->num_layers(); ++l) {
    if (meta.layer_lengths(l) != slot.model->layer_length(l)) {
      diffs.push_back(absl::StrCat("layer ", l, " length ", meta.layer_lengths(l), " != ", slot.model->layer_length(l)));
    }
  }
  const uint32_t pages = static_cast<uint32_t>(meta.kv_indices_size());
  if (pages < slot.model->pages() || pages > after->pages()) {
    diffs.push_back(absl::StrCat(pages, " pages, not between the ", slot.model->pages(), " before and the ",
                                 after->pages(), " after"));
  }
  if (diffs.empty()) return absl::OkStatus();
  return Mismatch(absl::StrCat("busy_sequence: during the append to ", slot.id, ": ", absl::StrJoin(diffs, "; ")));
}

absl::Status FaultInjector::BusySequence(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, PlanFor(slot, 2));
  if (!plan) return absl::OkStatus();
  const std::optional<SequenceModel> after = s_.planner().Apply(slot.model, *plan);
  const std::vector<v1::AppendRequest> requests = s_.planner().ToRequests(*plan);
  std::unique_ptr<grpc::ClientContext> context = s_.Context();
  v1::AppendResponse response;
  auto writer = s_.stub().Append(context.get(), &response);
  writer->Write(requests.front());
  const absl::Time opened = absl::Now();
  SleepMs(30);  // the server begins the transaction with the first message
  v1::AppendRequest probe;
  probe.set_pool(s_.options().pool);
  probe.set_sequence(slot.id);
  v1::AppendResponse probe_response;
  const grpc::Status second = s_.AppendStream({probe}, &probe_response);
  bool held = second.error_code() == grpc::StatusCode::ABORTED;
  if (held) {
    // While it is held: Free and Truncate refuse it, and no length has moved.
    const absl::Status freed = s_.client().Free(s_.options().pool, slot.id).status();
    const absl::Status cut = s_.client().Truncate(s_.options().pool, slot.id, 0).status();
    const absl::StatusCode want = slot.model ? absl::StatusCode::kAborted : absl::StatusCode::kNotFound;
    if (freed.code() != want || cut.code() != want) {
      return Mismatch(absl::StrCat("busy_sequence: Free and Truncate of ", slot.id,
                                   " during an append must be ", absl::StatusCodeToString(want), ", got ",
                                   freed.ToString(), " and ", cut.ToString()));
    }
    MLAKV_RETURN_IF_ERROR(CheckDuringAppend(slot, after));
  } else if (!second.ok()) {
    return ClientSession::ExpectCode(second, grpc::StatusCode::ABORTED, "busy_sequence: a second append");
  } else {
    s_.report().CountOutcome("busy_sequence", "not_yet_held");  // the first message was still on its way
  }
  bool alive = true;
  for (size_t i = 1; i + 1 < requests.size() && alive; ++i) alive = writer->Write(requests[i]);
  if (alive) writer->Write(requests.back(), grpc::WriteOptions().set_last_message());
  const grpc::Status status = writer->Finish();
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
      status.error_message().find("append_idle_timeout_seconds") != std::string::npos &&
      absl::Now() - opened >= s_.options().idle_timeout) {
    // A loaded machine stalled this client past the idle timeout: rolled back.
    s_.report().CountOutcome("busy_sequence", "idle_timeout_fired");
    return WithContext(s_.verifier().Verify(slot.id, slot.model), "busy_sequence: after the idle timeout");
  }
  if (held) {
    if (!status.ok()) {
      return Mismatch(absl::StrCat("busy_sequence: the held stream of ", slot.id, " failed: ",
                                   CodeName(status.error_code()), " ", status.error_message()));
    }
    s_.report().CountOutcome("busy_sequence", "held_then_committed");
  } else if (status.error_code() == grpc::StatusCode::ABORTED) {
    // The probe held the sequence when the stream's first message arrived.
    s_.report().CountOutcome("busy_sequence", "stream_lost_to_probe");
    return WithContext(s_.verifier().Verify(slot.id, slot.model), "busy_sequence: after the stream was ABORTED");
  }
  MLAKV_RETURN_IF_ERROR(WithContext(FromGrpcStatus(status), absl::StrCat("busy_sequence: the stream of ", slot.id)));
  MLAKV_RETURN_IF_ERROR(s_.CheckAppendResponse(response, *plan, slot.model, after));
  s_.Adopt(slot, *plan, after);
  return WithContext(s_.verifier().Verify(slot.id, slot.model), "busy_sequence: after the commit");
}

// ---- refused by the server --------------------------------------------------------

absl::Status FaultInjector::ParseTruncated(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, PlanFor(slot, 2));
  if (!plan) return absl::OkStatus();
  const int k = MessageWithRows(*plan, 1);
  if (k < 0) {
    s_.report().CountOutcome("skipped", "no_plan_fits");
    return absl::OkStatus();
  }
  std::vector<std::string> messages = Serialize(s_.planner().ToRequests(*plan));
  // The last field of a message with rows is a LayerRows of more than 100
  // bytes, so cutting up to 100 bytes always leaves it incomplete.
  std::string& cut = messages[k];
  cut.resize(cut.size() - s_.Uniform(1, 100));
  if (s_.Chance(0.5)) messages.resize(k + 1);  // or the valid rest follows it
  const RawAppendCall::Result result = RawAppendCall::Run(s_.channel(), messages, s_.options().call_timeout);
  return ExpectRefused(slot, result.status, grpc::StatusCode::INVALID_ARGUMENT, "parse_truncated");
}

absl::Status FaultInjector::ParseBadUtf8(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, PlanFor(slot, 2));
  if (!plan) return absl::OkStatus();
  std::vector<v1::AppendRequest> requests = s_.planner().ToRequests(*plan);
  const size_t k = s_.Uniform(1, static_cast<uint32_t>(requests.size()) - 1);
  requests[k].set_sequence(slot.id);
  std::vector<std::string> messages = Serialize(requests);
  const size_t at = messages[k].find(slot.id);
  if (at == std::string::npos) return absl::InternalError("parse_bad_utf8: the id is not in its own message");
  messages[k][at] = '\xff';  // never valid in UTF-8
  const RawAppendCall::Result result = RawAppendCall::Run(s_.channel(), messages, s_.options().call_timeout);
  return ExpectRefused(slot, result.status, grpc::StatusCode::INVALID_ARGUMENT, "parse_bad_utf8");
}

absl::Status FaultInjector::Oversize(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, PlanFor(slot, 1));
  if (!plan) return absl::OkStatus();
  std::vector<v1::AppendRequest> requests = s_.planner().ToRequests(*plan);
  const size_t k = s_.Uniform(0, static_cast<uint32_t>(requests.size()));
  // A well-formed message just over the limit: its size is its only fault.
  v1::AppendRequest big;
  const uint32_t rows = s_.options().max_message_bytes / kWireRowBytes + s_.Uniform(1, 64);
  if (k == 0) {
    big.set_pool(s_.options().pool);
    big.set_sequence(slot.id);
  }
  big.set_start(requests.front().start());
  big.set_row_count(rows);
  big.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  v1::LayerRows* layer = big.add_layers();
  layer->set_layer(0);
  layer->set_ckv(std::string(size_t{rows} * kWireCkvRowBytes, '\x3f'));
  layer->set_kpe(std::string(size_t{rows} * kWireKpeRowBytes, '\x3f'));
  if (k == 0) {
    // The pool and sequence travel in the first message.
    requests.front().clear_pool();
    requests.front().clear_sequence();
  }
  requests.insert(requests.begin() + k, std::move(big));
  const RawAppendCall::Result result =
      RawAppendCall::Run(s_.channel(), Serialize(requests), s_.options().call_timeout);
  return ExpectRefused(slot, result.status, grpc::StatusCode::RESOURCE_EXHAUSTED, "oversize_message");
}

absl::Status FaultInjector::IdleStream(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, PlanFor(slot, 1, 1));
  if (!plan) return absl::OkStatus();
  const std::vector<v1::AppendRequest> requests = s_.planner().ToRequests(*plan);
  const absl::Duration idle = s_.options().idle_timeout;
  std::unique_ptr<grpc::ClientContext> context = s_.Context(idle + absl::Seconds(20));
  v1::AppendResponse response;
  auto writer = s_.stub().Append(context.get(), &response);
  writer->Write(requests.front());
  const absl::Time sent = absl::Now();
  const grpc::Status status = writer->Finish();  // no half-close: the stream stalls until the server ends it
  const absl::Duration waited = absl::Now() - sent;
  MLAKV_RETURN_IF_ERROR(
      ClientSession::ExpectCode(status, grpc::StatusCode::DEADLINE_EXCEEDED, absl::StrCat("idle_stream of ", slot.id)));
  if (status.error_message().find("append_idle_timeout_seconds") == std::string::npos) {
    return Mismatch(absl::StrCat("idle_stream of ", slot.id, " ended by ", absl::FormatDuration(waited),
                                 " but not by the server's idle timeout: ", status.error_message()));
  }
  if (waited < idle - absl::Milliseconds(50)) {
    return Mismatch(absl::StrCat("idle_stream of ", slot.id, " was ended after ", absl::FormatDuration(waited),
                                 ", before the idle timeout of ", absl::FormatDuration(idle)));
  }
  s_.report().CountOutcome("idle_stream", waited < idle + absl::Seconds(2) ? "ended_in_time" : "ended_late");
  return WithContext(s_.verifier().Verify(slot.id, slot.model), "right after idle_stream was ended");
}

absl::Status FaultInjector::ExpectLengthMismatch(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, PlanFor(slot, 1));
  if (!plan) return absl::OkStatus();
  std::vector<v1::AppendRequest> requests = s_.planner().ToRequests(*plan);
  const PlannedMessage& first = plan->messages.front();
  const std::vector<uint32_t> have = LengthsBefore(slot.model, *plan, 0, s_.geometry().num_layers);
  uint32_t lo = UINT32_MAX, hi = 0;
  for (const PlannedLayer& l : first.layers) {
    lo = std::min(lo, have[l.rows.layer]);
    hi = std::max(hi, have[l.rows.layer]);
  }
  if (first.layers.empty()) lo = hi = slot.model ? slot.model->length() : 0;
  // Below what every written layer holds, or above: never equal to all of them.
  const uint32_t expect = lo > 0 && s_.Chance(0.5) ? s_.Uniform(0, lo - 1) : hi + s_.Uniform(1, 3);
  requests.front().set_expect_length(expect);
  v1::AppendResponse response;
  const grpc::Status status = s_.AppendStream(requests, &response);
  return ExpectRefused(slot, status, grpc::StatusCode::FAILED_PRECONDITION, "expect_length_mismatch");
}

absl::Status FaultInjector::Hole(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, PlanFor(slot, 1));
  if (!plan) return absl::OkStatus();
  const int k = MessageWithRows(*plan, 0);
  std::vector<v1::AppendRequest> requests = s_.planner().ToRequests(*plan);
  const std::vector<uint32_t> have = LengthsBefore(slot.model, *plan, k, s_.geometry().num_layers);
  uint32_t top = 0;
  for (const PlannedLayer& l : plan->messages[k].layers) top = std::max(top, have[l.rows.layer]);
  requests[k].set_start(top + s_.Uniform(1, 4));  // past what every layer it writes holds
  v1::AppendResponse response;
  const grpc::Status status = s_.AppendStream(requests, &response);
  return ExpectRefused(slot, status, grpc::StatusCode::OUT_OF_RANGE, "hole");
}

absl::Status FaultInjector::ScaleMismatch(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, PlanFor(slot, 1));
  if (!plan) return absl::OkStatus();
  const int k = MessageWithRows(*plan, 0);
  std::vector<v1::AppendRequest> requests = s_.planner().ToRequests(*plan);
  v1::LayerRows& layer = *requests[k].mutable_layers(
      static_cast<int>(s_.Uniform(0, static_cast<uint32_t>(requests[k].layers_size()) - 1)));
  const LayerScale& fixed = s_.geometry().scales[layer.layer()];
  layer.set_ckv_scale(fixed.ckv * 2);  // the config fixed them: other scales are refused
  layer.set_kpe_scale(fixed.kpe);
  v1::AppendResponse response;
  const grpc::Status status = s_.AppendStream(requests, &response);
  return ExpectRefused(slot, status, grpc::StatusCode::FAILED_PRECONDITION, "scale_mismatch");
}

absl::Status FaultInjector::InvalidMessage(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, PlanFor(slot, 1));
  if (!plan) return absl::OkStatus();
  const int k = MessageWithRows(*plan, 0);
  std::vector<v1::AppendRequest> requests = s_.planner().ToRequests(*plan);
  v1::AppendRequest& m = requests[k];
  // Each variant is one row of docs/server.md "Errors".
  const uint32_t variant = s_.Uniform(0, k > 0 ? 7 : 4);
  grpc::StatusCode code = grpc::StatusCode::INVALID_ARGUMENT;
  std::string what;
  switch (variant) {
    case 0:
      m.mutable_layers(0)->set_layer(static_cast<uint32_t>(s_.geometry().num_layers) + s_.Uniform(0, 3));
      code = grpc::StatusCode::OUT_OF_RANGE;
      what = "layer_out_of_range";
      break;
    case 1:
      m.mutable_layers(0)->mutable_ckv()->resize(m.layers(0).ckv().size() - 2);
      what = "ckv_byte_count";
      break;
    case 2:
      *m.add_layers() = m.layers(0);
      what = "layer_twice";
      break;
    case 3:
      m.set_dtype(v1::ROW_DTYPE_UNSPECIFIED);
      what = "dtype_unset";
      break;
    case 4:
      m.clear_layers();  // row_count > 0 with no layers
      what = "rows_without_layers";
      break;
    case 5:
      m.set_sequence(slot.id + "-other");
      what = "other_sequence_later";
      break;
    case 6:
      m.set_reserve_tokens(1);
      what = "reserve_later";
      break;
    default:
      m.set_view(v1::SEQUENCE_VIEW_BASIC);
      what = "view_later";
      break;
  }
  s_.report().CountOutcome("invalid_message", what);
  v1::AppendResponse response;
  const grpc::Status status = s_.AppendStream(requests, &response);
  return ExpectRefused(slot, status, code, absl::StrCat("invalid_message (", what, ")"));
}

absl::Status FaultInjector::BatchBadEntry(std::vector<Slot*>* touched) {
  MLAKV_ASSIGN_OR_RETURN(BatchPlan batch, s_.PlanBatch(3));
  touched->insert(touched->end(), batch.slots.begin(), batch.slots.end());
  if (batch.plans.empty()) return absl::OkStatus();
  const int j = static_cast<int>(s_.Uniform(0, static_cast<uint32_t>(batch.plans.size()) - 1));
  v1::SequenceRows& entry = *batch.request.mutable_sequences(j);
  const std::optional<SequenceModel>& model = batch.before[j];
  uint32_t top = 0;
  for (const v1::LayerRows& l : entry.layers()) top = std::max(top, model ? model->layer_length(l.layer()) : 0u);
  grpc::StatusCode code;
  std::string what;
  switch (s_.Uniform(0, 4)) {
    case 0:
      entry.set_start(top + s_.Uniform(1, 4));
      code = grpc::StatusCode::OUT_OF_RANGE;
      what = "hole";
      break;
    case 1:
      entry.set_expect_length(top + s_.Uniform(1, 3));
      code = grpc::StatusCode::FAILED_PRECONDITION;
      what = "expect_length";
      break;
    case 2:
      entry.mutable_layers(0)->set_layer(static_cast<uint32_t>(s_.geometry().num_layers));
      code = grpc::StatusCode::OUT_OF_RANGE;
      what = "layer_out_of_range";
      break;
    case 3:
      *batch.request.add_sequences() = entry;  // a sequence twice in one batch
      code = grpc::StatusCode::INVALID_ARGUMENT;
      what = "sequence_twice";
      break;
    default: {
      // Over max_message_bytes as a whole.
      const uint32_t rows = s_.options().max_message_bytes / kWireRowBytes + s_.Uniform(1, 64);
      v1::LayerRows* layer = entry.mutable_layers(0);
      layer->set_ckv(std::string(size_t{rows} * kWireCkvRowBytes, '\x3f'));
      layer->set_kpe(std::string(size_t{rows} * kWireKpeRowBytes, '\x3f'));
      entry.set_row_count(rows);
      entry.mutable_layers()->DeleteSubrange(1, entry.layers_size() - 1);
      code = grpc::StatusCode::RESOURCE_EXHAUSTED;
      what = "oversize";
      break;
    }
  }
  s_.report().CountOutcome("batch_bad_entry", what);
  const absl::Status status = s_.client().AppendBatch(batch.request).status();
  const grpc::Status as_grpc(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
  MLAKV_RETURN_IF_ERROR(ClientSession::ExpectCode(as_grpc, code, absl::StrCat("batch_bad_entry (", what, ")")));
  for (size_t i = 0; i < batch.plans.size(); ++i) {
    MLAKV_RETURN_IF_ERROR(WithContext(s_.verifier().Verify(batch.slots[i]->id, batch.before[i]),
                                      absl::StrCat("right after batch_bad_entry (", what, ") was refused")));
  }
  return absl::OkStatus();
}

}  // namespace mlakv::soak
