#include "tests/soak/client_session.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/append_stream.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace mlakv::soak {
namespace {

// How long an ABORTED is retried after a stream this client ended itself.
constexpr absl::Duration kHeldGrace = absl::Seconds(10);
constexpr absl::Duration kRetryFor = absl::Seconds(5);

// The id of slot `k` of client `index`. Slot 0 is long and not ASCII: ids
// are any UTF-8 of 1..1024 bytes, and one of them travels in every message.
std::string SlotId(const std::string& prefix, int index, int k) {
  std::string id = absl::StrCat(prefix, "c", index, "-s", k);
  if (k == 0) absl::StrAppend(&id, "-\xc3\xbc" "n\xc3\xaf" "c\xc3\xb6" "d\xc3\xa9-", std::string(160, 'x'));
  return id;
}

// Views whose responses leave pool, id and server_id empty.
bool Unnamed(v1::SequenceView view) {
  return view == v1::SEQUENCE_VIEW_COMPACT || view == v1::SEQUENCE_VIEW_LENGTHS;
}

bool MayBeHeld(const std::vector<const Slot*>& slots) {
  const absl::Time now = absl::Now();
  for (const Slot* s : slots) {
    if (now - s->client_ended < kHeldGrace) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ClientSession>> ClientSession::Create(int index, const std::string& target,
                                                                     const SoakOptions& options,
                                                                     const PoolGeometry& geometry,
                                                                     SoakReport* report) {
  KvCacheClient::Options o;
  o.target = target;
  o.timeout = options.call_timeout;
  // Small messages: the library's own splitting of an append into a stream
  // of several messages is exercised on every append_lib of a few rows.
  o.append_message_bytes = 16 << 10;
  MLAKV_ASSIGN_OR_RETURN(std::unique_ptr<KvCacheClient> client, KvCacheClient::Create(o));
  return std::unique_ptr<ClientSession>(
      new ClientSession(index, target, options, geometry, report, std::move(client)));
}

ClientSession::ClientSession(int index, std::string target, const SoakOptions& options, const PoolGeometry& geometry,
                             SoakReport* report, std::unique_ptr<KvCacheClient> client)
    : index_(index),
      target_(std::move(target)),
      options_(options),
      geometry_(geometry),
      report_(report),
      rng_(options.seed * 1000003 + index),
      client_(std::move(client)),
      channel_(NewChannel(target_)),
      stub_(v1::KvCache::NewStub(channel_)),
      rows_(geometry.scales),
      planner_(options, geometry, rows_),
      verifier_(client_.get(), options, geometry) {
  for (int k = 0; k < options.sequences_per_client; ++k) {
    Slot& slot = slots_.emplace_back();
    slot.id = SlotId(options.run_prefix, index, k);
  }
}

bool ClientSession::Chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }

uint32_t ClientSession::Uniform(uint32_t lo, uint32_t hi) {
  return std::uniform_int_distribution<uint32_t>(lo, hi)(rng_);
}

absl::Duration ClientSession::RaceDeadline() {
  const double log_us = std::uniform_real_distribution<double>(std::log(20.0), std::log(10000.0))(rng_);
  return absl::Microseconds(std::exp(log_us));
}

Slot& ClientSession::AnySlot() { return slots_[Uniform(0, static_cast<uint32_t>(slots_.size()) - 1)]; }

Slot* ClientSession::ExistingSlot() {
  std::vector<Slot*> found;
  for (Slot& s : slots_) {
    if (s.model) found.push_back(&s);
  }
  return found.empty() ? nullptr : found[Uniform(0, static_cast<uint32_t>(found.size()) - 1)];
}

Slot* ClientSession::EmptySlot() {
  std::vector<Slot*> found;
  for (Slot& s : slots_) {
    if (!s.model) found.push_back(&s);
  }
  return found.empty() ? nullptr : found[Uniform(0, static_cast<uint32_t>(found.size()) - 1)];
}

absl::StatusOr<BatchPlan> ClientSession::PlanBatch(uint32_t max_entries) {
  BatchPlan batch;
  const v1::RowDType dtype = RandomDType(rng_);
  const uint32_t want = Uniform(2, std::max<uint32_t>(2, std::min<uint32_t>(max_entries, slots_.size())));
  std::vector<Slot*> order;
  for (Slot& slot : slots_) order.push_back(&slot);
  std::shuffle(order.begin(), order.end(), rng_);
  constexpr v1::SequenceView kViews[] = {v1::SEQUENCE_VIEW_FULL, v1::SEQUENCE_VIEW_BASIC, v1::SEQUENCE_VIEW_COMPACT,
                                         v1::SEQUENCE_VIEW_LENGTHS};
  batch.view = kViews[Uniform(0, 3)];
  batch.request.set_pool(options_.pool);
  batch.request.set_dtype(dtype);
  batch.request.set_view(batch.view);
  for (Slot* slot : order) {
    if (batch.plans.size() == want) break;
    MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan, planner_.PlanBatchEntry(rng_, slot->id, slot->model, dtype));
    if (!plan) continue;
    planner_.ToBatchEntry(*plan, batch.request.add_sequences());
    batch.slots.push_back(slot);
    batch.before.push_back(slot->model);
    batch.after.push_back(planner_.Apply(slot->model, *plan));
    batch.plans.push_back(*std::move(plan));
  }
  return batch;
}

std::unique_ptr<grpc::ClientContext> ClientSession::Context(std::optional<absl::Duration> timeout) const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout.value_or(options_.call_timeout)));
  return context;
}

std::shared_ptr<grpc::Channel> ClientSession::NewChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);  // the oversized-message fault must reach the server
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

grpc::Status ClientSession::AppendStream(const std::vector<v1::AppendRequest>& requests,
                                         v1::AppendResponse* response, std::optional<absl::Duration> timeout) {
  std::unique_ptr<grpc::ClientContext> context = Context(timeout);
  std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> writer = stub_->Append(context.get(), response);
  return WriteAppendStream<v1::AppendRequest>(*writer, requests.size(), [&](size_t i) { return requests[i]; });
}

grpc::Status ClientSession::RetryAborted(const std::vector<const Slot*>& slots,
                                         const std::function<grpc::Status()>& call) {
  const absl::Time until = absl::Now() + kRetryFor;
  for (;;) {
    grpc::Status status = call();
    if (status.error_code() != grpc::StatusCode::ABORTED || !MayBeHeld(slots) || absl::Now() > until) return status;
    report_->CountOutcome("retry", "aborted_after_client_ended_stream");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

absl::Status ClientSession::RetryAborted(const std::vector<const Slot*>& slots,
                                         const std::function<absl::Status()>& call) {
  const absl::Time until = absl::Now() + kRetryFor;
  for (;;) {
    absl::Status status = call();
    if (!absl::IsAborted(status) || !MayBeHeld(slots) || absl::Now() > until) return status;
    report_->CountOutcome("retry", "aborted_after_client_ended_stream");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

absl::Status ClientSession::Settle(Slot& slot) {
  slot.client_ended = absl::Now();
  v1::AppendRequest probe;
  probe.set_pool(options_.pool);
  probe.set_sequence(slot.id);
  probe.set_view(v1::SEQUENCE_VIEW_FULL);
  const absl::Time deadline = absl::Now() + options_.settle_timeout;
  std::optional<std::string> last;
  absl::Time quiet_since;
  int held = 0;
  while (absl::Now() < deadline) {
    v1::AppendResponse response;
    const grpc::Status status = AppendStream({probe}, &response);
    if (status.error_code() == grpc::StatusCode::ABORTED) {
      ++held;
      last.reset();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    if (!status.ok()) {
      return Mismatch(absl::StrCat("settle probe (a zero-row Append) of ", slot.id, " failed: ",
                                   absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())), " ",
                                   status.error_message()));
    }
    const std::string state = response.sequence().SerializeAsString();
    if (last != state) {
      last = state;
      quiet_since = absl::Now();
    } else if (absl::Now() - quiet_since >= options_.settle_quiet) {
      if (held > 0) report_->CountOutcome("settle", "was_still_held");
      return absl::OkStatus();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  return Mismatch(absl::StrCat("sequence ", slot.id, " is still held (ABORTED) or changing ",
                               absl::FormatDuration(options_.settle_timeout),
                               " after the client ended its stream; the rollback never finished"));
}

void ClientSession::Resync(Slot& slot) {
  (void)Settle(slot);
  absl::StatusOr<uint32_t> freed = client_->Free(options_.pool, slot.id);
  if (!freed.ok() && !absl::IsNotFound(freed.status())) {
    report_->Violation(absl::StrCat("client ", index_, " resync"),
                       absl::StrCat("cannot free ", slot.id, " after a violation: ", freed.status().ToString()));
  }
  slot.model.reset();
}

namespace {

uint32_t PagesOf(const std::optional<SequenceModel>& m) { return m ? m->pages() : 0; }

}  // namespace

absl::Status ClientSession::CheckAppendResponse(const v1::AppendResponse& response, const StreamPlan& plan,
                                                const std::optional<SequenceModel>& before,
                                                const std::optional<SequenceModel>& after) const {
  std::vector<std::string> diffs;
  if (response.rows_written() != plan.rows_written()) {
    diffs.push_back(absl::StrCat("rows_written ", response.rows_written(), " != ", plan.rows_written()));
  }
  const uint32_t allocated = PagesOf(after) - PagesOf(before);
  if (response.pages_allocated() != allocated) {
    diffs.push_back(absl::StrCat("pages_allocated ", response.pages_allocated(), " != ", allocated));
  }
  if (response.sequence().id() != (Unnamed(plan.view) ? "" : plan.sequence)) {
    diffs.push_back("sequence.id is not the appended sequence (or not empty in the COMPACT or LENGTHS view)");
  }
  const SequenceModel nothing(geometry_.num_layers, geometry_.page_size);
  if (const std::string d = verifier_.DiffMeta(response.sequence(), after ? *after : nothing, plan.view,
                                               PagesOf(before));
      !d.empty()) {
    diffs.push_back(absl::StrCat("sequence: ", d));
  }
  if (diffs.empty()) return absl::OkStatus();
  return Mismatch(absl::StrCat("AppendResponse for ", plan.sequence, ": ", absl::StrJoin(diffs, "; ")));
}

absl::Status ClientSession::CheckBatchResponse(const v1::AppendBatchResponse& response, v1::SequenceView view,
                                               const std::vector<StreamPlan>& plans,
                                               const std::vector<std::optional<SequenceModel>>& before,
                                               const std::vector<std::optional<SequenceModel>>& after) const {
  std::vector<std::string> diffs;
  uint64_t rows = 0;
  uint32_t pages = 0;
  if (response.sequences_size() != static_cast<int>(plans.size())) {
    return Mismatch(absl::StrCat("AppendBatchResponse has ", response.sequences_size(), " sequences for ",
                                 plans.size(), " entries"));
  }
  for (size_t i = 0; i < plans.size(); ++i) {
    rows += plans[i].rows_written();
    pages += PagesOf(after[i]) - PagesOf(before[i]);
    const v1::Sequence& seq = response.sequences(static_cast<int>(i));
    if (seq.id() != (Unnamed(view) ? "" : plans[i].sequence)) {
      diffs.push_back(absl::StrCat("entry ", i, " is '", seq.id(), "'"));
    }
    if (const std::string d = verifier_.DiffMeta(seq, *after[i], view, PagesOf(before[i])); !d.empty()) {
      diffs.push_back(absl::StrCat("entry ", i, " (", plans[i].sequence, "): ", d));
    }
  }
  if (response.rows_written() != rows) diffs.push_back(absl::StrCat("rows_written ", response.rows_written(), " != ", rows));
  if (response.pages_allocated() != pages) {
    diffs.push_back(absl::StrCat("pages_allocated ", response.pages_allocated(), " != ", pages));
  }
  if (diffs.empty()) return absl::OkStatus();
  return Mismatch(absl::StrCat("AppendBatchResponse: ", absl::StrJoin(diffs, "; ")));
}

void ClientSession::Adopt(Slot& slot, const StreamPlan& plan, std::optional<SequenceModel> after) {
  slot.model = std::move(after);
  report_->AddAppended(plan.rows_written(), plan.wire_bytes());
}

absl::Status ClientSession::ExpectCode(const grpc::Status& status, grpc::StatusCode code, absl::string_view what) {
  if (status.error_code() == code) return absl::OkStatus();
  return Mismatch(absl::StrCat(what, ": expected ", absl::StatusCodeToString(static_cast<absl::StatusCode>(code)),
                               ", got ", absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
                               " ", status.error_message()));
}

}  // namespace mlakv::soak
