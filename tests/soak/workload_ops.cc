#include "tests/soak/workload_ops.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace mlakv::soak {
namespace {

absl::Status FromGrpc(const grpc::Status& status, absl::string_view what) {
  return WithContext(FromGrpcStatus(status), what);
}

// Ops by weight: what one client step does when it injects no fault.
struct Weighted {
  const char* name;
  int weight;
};
constexpr Weighted kOps[] = {
    {"append", 30},  {"rewrite", 10},  {"append_lib", 8}, {"batch", 10},       {"read", 16},
    {"free", 5},     {"truncate", 8},  {"truncate_beyond", 1}, {"missing", 2}, {"empty_append", 2},
};

}  // namespace

absl::Status WorkloadOps::RunOne(std::string* name, std::vector<Slot*>* touched) {
  int total = 0;
  for (const Weighted& w : kOps) total += w.weight;
  int pick = static_cast<int>(s_.Uniform(0, total - 1));
  std::string op;
  for (const Weighted& w : kOps) {
    if (pick < w.weight) {
      op = w.name;
      break;
    }
    pick -= w.weight;
  }
  // Ops on an existing sequence fall back to an append when there is none,
  // ops on a missing one to a read when every slot is taken.
  Slot* existing = s_.ExistingSlot();
  Slot* empty = s_.EmptySlot();
  auto needs_existing = [](const std::string& o) {
    return o == "rewrite" || o == "read" || o == "free" || o == "truncate" || o == "truncate_beyond";
  };
  auto needs_empty = [](const std::string& o) { return o == "missing" || o == "empty_append"; };
  if (needs_existing(op) && existing == nullptr) op = "append";
  if (needs_empty(op) && empty == nullptr) op = "read";
  *name = op;
  s_.report().CountOp(op);
  if (op == "batch") return Batch(touched);
  Slot& slot = needs_existing(op) ? *existing : needs_empty(op) ? *empty : s_.AnySlot();
  touched->push_back(&slot);
  if (op == "append") return Append(slot, AppendShape::kMixed);
  if (op == "rewrite") return Append(slot, AppendShape::kRewrite);
  if (op == "append_lib") return AppendLib(slot);
  if (op == "read") return Read(slot);
  if (op == "free") return Free(slot);
  if (op == "truncate") return Truncate(slot);
  if (op == "truncate_beyond") return TruncateBeyond(slot);
  if (op == "missing") return Missing(slot);
  return EmptyAppend(slot);
}

absl::Status WorkloadOps::Commit(Slot& slot, const StreamPlan& plan) {
  const std::optional<SequenceModel> after = s_.planner().Apply(slot.model, plan);
  const std::vector<v1::AppendRequest> requests = s_.planner().ToRequests(plan);
  v1::AppendResponse response;
  const grpc::Status status = s_.RetryAborted({&slot}, [&] {
    response.Clear();
    return s_.AppendStream(requests, &response);
  });
  MLAKV_RETURN_IF_ERROR(FromGrpc(status, absl::StrCat("Append of ", requests.size(), " message(s) to ", slot.id)));
  MLAKV_RETURN_IF_ERROR(s_.CheckAppendResponse(response, plan, slot.model, after));
  s_.Adopt(slot, plan, after);
  if (!slot.model) return s_.verifier().Verify(slot.id, std::nullopt, false);  // nothing kept
  return absl::OkStatus();
}

absl::Status WorkloadOps::Append(Slot& slot, AppendShape shape) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan,
                         s_.planner().PlanStream(s_.rng(), slot.id, slot.model, {.shape = shape}));
  if (!plan) {
    // Full (or, for a rewrite, empty): make room instead.
    return slot.model ? Truncate(slot) : absl::OkStatus();
  }
  return Commit(slot, *plan);
}

absl::Status WorkloadOps::AppendLib(Slot& slot) {
  MLAKV_ASSIGN_OR_RETURN(std::optional<StreamPlan> plan,
                         s_.planner().PlanStream(s_.rng(), slot.id, slot.model,
                                                 {.shape = AppendShape::kExtend, .max_messages = 1}));
  if (!plan || plan->messages.front().layers.empty()) return absl::OkStatus();
  const PlannedMessage& m = plan->messages.front();
  AppendRows rows;
  rows.pool = s_.options().pool;
  rows.sequence = slot.id;
  rows.start = m.start;
  rows.rows = m.rows;
  rows.dtype = m.dtype;
  rows.reserve_tokens = plan->reserve_tokens;
  rows.expect_length = plan->expect_length;
  rows.view = plan->view;
  for (const PlannedLayer& l : m.layers) {
    LayerBytes& b = rows.layers.emplace_back();
    b.layer = l.rows.layer;
    b.ckv = l.rows.ckv;
    b.kpe = l.rows.kpe;
    if (l.name_scales) {
      b.ckv_scale = s_.geometry().scales[l.rows.layer].ckv;
      b.kpe_scale = s_.geometry().scales[l.rows.layer].kpe;
    }
  }
  const std::optional<SequenceModel> after = s_.planner().Apply(slot.model, *plan);
  absl::StatusOr<v1::AppendResponse> response;
  MLAKV_RETURN_IF_ERROR(s_.RetryAborted({&slot}, [&]() -> absl::Status {
    response = s_.client().Append(rows);
    return response.status();
  }));
  MLAKV_RETURN_IF_ERROR(s_.CheckAppendResponse(*response, *plan, slot.model, after));
  s_.Adopt(slot, *plan, after);
  return absl::OkStatus();
}

absl::Status WorkloadOps::Batch(std::vector<Slot*>* touched) {
  MLAKV_ASSIGN_OR_RETURN(BatchPlan batch, s_.PlanBatch(4));
  touched->insert(touched->end(), batch.slots.begin(), batch.slots.end());
  if (batch.plans.empty()) return absl::OkStatus();
  absl::StatusOr<v1::AppendBatchResponse> response;
  MLAKV_RETURN_IF_ERROR(s_.RetryAborted({batch.slots.begin(), batch.slots.end()}, [&]() -> absl::Status {
    response = s_.client().AppendBatch(batch.request);
    return response.status();
  }));
  MLAKV_RETURN_IF_ERROR(s_.CheckBatchResponse(*response, batch.view, batch.plans, batch.before, batch.after));
  for (size_t i = 0; i < batch.plans.size(); ++i) s_.Adopt(*batch.slots[i], batch.plans[i], batch.after[i]);
  return absl::OkStatus();
}

absl::Status WorkloadOps::Read(Slot& slot) {
  MLAKV_RETURN_IF_ERROR(s_.verifier().Verify(slot.id, slot.model));
  const SequenceModel& model = *slot.model;
  std::vector<int> written;
  for (int l = 0; l < model.num_layers(); ++l) {
    if (model.layer_length(l) > 0) written.push_back(l);
  }
  if (written.empty()) return absl::OkStatus();
  const int layer = written[s_.Uniform(0, static_cast<uint32_t>(written.size()) - 1)];
  if (s_.Chance(0.3)) {
    const uint32_t len = model.layer_length(layer);
    const uint32_t start = s_.Uniform(0, len - 1);
    MLAKV_RETURN_IF_ERROR(s_.verifier().VerifyRange(slot.id, model, layer, start, s_.Uniform(1, len - start)));
  }
  if (s_.Chance(0.15)) MLAKV_RETURN_IF_ERROR(s_.verifier().VerifyDequantized(s_.stub(), slot.id, model, layer));
  return absl::OkStatus();
}

absl::Status WorkloadOps::Free(Slot& slot) {
  absl::StatusOr<uint32_t> freed;
  MLAKV_RETURN_IF_ERROR(s_.RetryAborted({&slot}, [&]() -> absl::Status {
    freed = s_.client().Free(s_.options().pool, slot.id);
    return freed.status();
  }));
  const uint32_t pages = slot.model->pages();
  slot.model.reset();
  if (*freed != pages) {
    return Mismatch(absl::StrCat("FreeSequence ", slot.id, " returned ", *freed, " pages; it held ", pages));
  }
  return s_.verifier().Verify(slot.id, std::nullopt, false);
}

absl::Status WorkloadOps::Truncate(Slot& slot) {
  const uint32_t longest = slot.model->max_length();
  const uint32_t r = s_.Uniform(0, 9);
  const uint32_t length = r < 2 ? 0 : r == 2 ? longest : s_.Uniform(0, longest);
  absl::StatusOr<v1::Sequence> response;
  MLAKV_RETURN_IF_ERROR(s_.RetryAborted({&slot}, [&]() -> absl::Status {
    response = s_.client().Truncate(s_.options().pool, slot.id, length);
    return response.status();
  }));
  SequenceModel after = *slot.model;
  after.Truncate(length);
  if (const std::string d = s_.verifier().DiffMeta(*response, after, v1::SEQUENCE_VIEW_FULL); !d.empty()) {
    slot.model = after;
    return Mismatch(absl::StrCat("TruncateSequence ", slot.id, " to ", length, ": ", d));
  }
  if (after.empty()) {
    slot.model.reset();  // cut to nothing: the server keeps no such sequence
    return s_.verifier().Verify(slot.id, std::nullopt, false);
  }
  slot.model = std::move(after);
  return s_.Chance(0.3) ? s_.verifier().Verify(slot.id, slot.model) : absl::OkStatus();
}

absl::Status WorkloadOps::TruncateBeyond(Slot& slot) {
  const uint32_t length = slot.model->max_length() + s_.Uniform(1, 8);
  const absl::Status status = s_.client().Truncate(s_.options().pool, slot.id, length).status();
  if (!absl::IsOutOfRange(status)) {
    return Mismatch(absl::StrCat("TruncateSequence ", slot.id, " to ", length, " past its longest layer (",
                                 slot.model->max_length(), "): expected OUT_OF_RANGE, got ", status.ToString()));
  }
  return s_.verifier().Verify(slot.id, slot.model, false);
}

absl::Status WorkloadOps::Missing(Slot& slot) {
  const std::string& pool = s_.options().pool;
  const std::pair<const char*, absl::Status> answers[] = {
      {"GetSequence", s_.client().GetSequence(pool, slot.id).status()},
      {"FreeSequence", s_.client().Free(pool, slot.id).status()},
      {"TruncateSequence", s_.client().Truncate(pool, slot.id, 0).status()},
      {"ReadSequence", s_.client().ReadLayer(pool, slot.id, 0).status()},
  };
  for (const auto& [call, status] : answers) {
    if (!absl::IsNotFound(status)) {
      return Mismatch(absl::StrCat(call, " of ", slot.id, ", which does not exist: expected NOT_FOUND, got ",
                                   status.ToString()));
    }
  }
  return absl::OkStatus();
}

absl::Status WorkloadOps::EmptyAppend(Slot& slot) {
  // A zero-row append to a new id commits and keeps nothing.
  StreamPlan plan;
  plan.sequence = slot.id;
  plan.messages.emplace_back();
  return Commit(slot, plan);
}

void WorkloadOps::FreeAll() {
  for (Slot& slot : s_.slots()) {
    if (!slot.model) continue;
    if (absl::Status s = Free(slot); !s.ok()) {
      s_.report().Violation(absl::StrCat("client ", s_.index(), " free_all"), s.message());
    }
  }
}

}  // namespace mlakv::soak
