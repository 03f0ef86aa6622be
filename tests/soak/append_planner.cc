#include "tests/soak/append_planner.h"

#include <algorithm>
#include <numeric>

#include "common/status_macros.h"

namespace mlakv::soak {
namespace {

bool Chance(std::mt19937_64& rng, double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; }

uint32_t Uniform(std::mt19937_64& rng, uint32_t lo, uint32_t hi) {  // [lo, hi]
  return std::uniform_int_distribution<uint32_t>(lo, hi)(rng);
}

std::vector<uint32_t> LengthsOf(const std::optional<SequenceModel>& model, int num_layers) {
  std::vector<uint32_t> have(num_layers, 0);
  if (model) {
    for (int l = 0; l < num_layers; ++l) have[l] = model->layer_length(l);
  }
  return have;
}

}  // namespace

v1::RowDType RandomDType(std::mt19937_64& rng) {
  return Chance(rng, 0.5) ? v1::ROW_DTYPE_BFLOAT16 : v1::ROW_DTYPE_FLOAT16;
}

uint64_t StreamPlan::rows_written() const {
  uint64_t n = 0;
  for (const PlannedMessage& m : messages) n += uint64_t{m.rows} * m.layers.size();
  return n;
}

uint64_t StreamPlan::wire_bytes() const { return rows_written() * kWireRowBytes; }

absl::StatusOr<std::optional<PlannedMessage>> AppendPlanner::PlanMessage(std::mt19937_64& rng,
                                                                         std::vector<uint32_t>& have,
                                                                         AppendShape shape, v1::RowDType dtype,
                                                                         int max_layers) const {
  // Candidate layers: a rewrite needs written positions; an extension room below max_tokens.
  auto candidates_for = [&](AppendShape s) {
    std::vector<uint32_t> out;
    for (int l = 0; l < geometry_.num_layers; ++l) {
      if (s == AppendShape::kRewrite ? have[l] > 0 : have[l] < options_.max_tokens) out.push_back(l);
    }
    return out;
  };
  const bool mixed = shape == AppendShape::kMixed;
  if (mixed) shape = Chance(rng, 0.7) ? AppendShape::kExtend : AppendShape::kRewrite;
  std::vector<uint32_t> candidates = candidates_for(shape);
  if (candidates.empty() && mixed) {
    shape = shape == AppendShape::kExtend ? AppendShape::kRewrite : AppendShape::kExtend;
    candidates = candidates_for(shape);
  }
  if (candidates.empty()) return std::nullopt;
  std::shuffle(candidates.begin(), candidates.end(), rng);
  const uint32_t count = Uniform(rng, 1, std::min<uint32_t>(candidates.size(), max_layers));
  candidates.resize(count);
  std::sort(candidates.begin(), candidates.end());
  uint32_t lowest = options_.max_tokens;
  for (uint32_t l : candidates) lowest = std::min(lowest, have[l]);

  PlannedMessage m;
  m.dtype = dtype;
  m.repeat_ids = Chance(rng, 0.5);
  m.start = shape == AppendShape::kRewrite ? Uniform(rng, 0, lowest - 1) : lowest;
  const uint32_t room = options_.max_tokens - m.start;
  m.rows = Uniform(rng, 1, std::min(room, options_.max_rows_per_message));
  for (uint32_t l : candidates) {
    PlannedLayer layer;
    MLAKV_ASSIGN_OR_RETURN(layer.rows, rows_.Make(rng, l, m.rows, dtype));
    layer.name_scales = Chance(rng, 0.1);
    m.layers.push_back(std::move(layer));
    have[l] = std::max(have[l], m.start + m.rows);
  }
  return m;
}

absl::StatusOr<std::optional<StreamPlan>> AppendPlanner::PlanStream(std::mt19937_64& rng, const std::string& id,
                                                                   const std::optional<SequenceModel>& before,
                                                                   const PlanRequest& request) const {
  StreamPlan plan;
  plan.sequence = id;
  const std::vector<uint32_t> committed = LengthsOf(before, geometry_.num_layers);
  std::vector<uint32_t> have = committed;
  const int messages = static_cast<int>(Uniform(rng, request.min_messages, request.max_messages));
  const int max_layers = std::min(geometry_.num_layers, 4);
  for (int i = 0; i < messages; ++i) {
    if (i > 0 && Chance(rng, 0.05)) {
      PlannedMessage& nothing = plan.messages.emplace_back();  // carries nothing: allowed
      nothing.repeat_ids = Chance(rng, 0.5);
      continue;
    }
    MLAKV_ASSIGN_OR_RETURN(std::optional<PlannedMessage> m,
                           PlanMessage(rng, have, request.shape, RandomDType(rng), max_layers));
    if (!m) break;
    plan.messages.push_back(std::move(*m));
  }
  const bool is_new = !before.has_value();
  if (request.allow_reserve && Chance(rng, is_new ? 0.3 : 0.05)) {
    plan.reserve_tokens = Uniform(rng, 1, options_.max_tokens);
    // A new sequence that only reserves: it holds pages and no token.
    if (is_new && Chance(rng, 0.15)) plan.messages.clear();
  }
  if (plan.messages.empty()) {
    if (plan.reserve_tokens == 0) return std::nullopt;
    plan.messages.push_back(PlannedMessage{});
  }
  // expect_length: the first message's layers all hold exactly its start.
  const PlannedMessage& first = plan.messages.front();
  bool at_end = true;
  for (const PlannedLayer& l : first.layers) at_end = at_end && committed[l.rows.layer] == first.start;
  if (request.allow_expect && at_end && Chance(rng, 0.5)) {
    plan.expect_length = first.layers.empty() ? (before ? before->length() : 0) : first.start;
  }
  constexpr v1::SequenceView kViews[] = {v1::SEQUENCE_VIEW_UNSPECIFIED, v1::SEQUENCE_VIEW_FULL, v1::SEQUENCE_VIEW_BASIC,
                                         v1::SEQUENCE_VIEW_COMPACT, v1::SEQUENCE_VIEW_LENGTHS};
  plan.view = kViews[Uniform(rng, 0, 4)];
  return plan;
}

absl::StatusOr<std::optional<StreamPlan>> AppendPlanner::PlanBatchEntry(std::mt19937_64& rng, const std::string& id,
                                                                       const std::optional<SequenceModel>& before,
                                                                       v1::RowDType dtype) const {
  std::vector<uint32_t> have = LengthsOf(before, geometry_.num_layers);
  const std::vector<uint32_t> committed = have;
  MLAKV_ASSIGN_OR_RETURN(std::optional<PlannedMessage> m,
                         PlanMessage(rng, have, AppendShape::kMixed, dtype, std::min(geometry_.num_layers, 2)));
  if (!m) return std::nullopt;
  StreamPlan plan;
  plan.sequence = id;
  bool at_end = true;
  for (const PlannedLayer& l : m->layers) at_end = at_end && committed[l.rows.layer] == m->start;
  if (at_end && Chance(rng, 0.5)) plan.expect_length = m->start;
  plan.messages.push_back(std::move(*m));
  return plan;
}

std::optional<SequenceModel> AppendPlanner::Apply(const std::optional<SequenceModel>& before,
                                                  const StreamPlan& plan) const {
  SequenceModel after = before ? *before : SequenceModel(geometry_.num_layers, geometry_.page_size);
  after.CoverTokens(plan.reserve_tokens);
  for (const PlannedMessage& m : plan.messages) {
    for (const PlannedLayer& l : m.layers) after.Write(static_cast<int>(l.rows.layer), m.start, l.rows.stored);
  }
  if (!before && after.empty()) return std::nullopt;  // an append that leaves nothing keeps no new id
  return after;
}

void AppendPlanner::FillLayer(const PlannedLayer& layer, v1::LayerRows* out) const {
  out->set_layer(layer.rows.layer);
  out->set_ckv(layer.rows.ckv);
  out->set_kpe(layer.rows.kpe);
  if (layer.name_scales) {
    out->set_ckv_scale(geometry_.scales[layer.rows.layer].ckv);
    out->set_kpe_scale(geometry_.scales[layer.rows.layer].kpe);
  }
}

std::vector<v1::AppendRequest> AppendPlanner::ToRequests(const StreamPlan& plan) const {
  std::vector<v1::AppendRequest> out;
  for (size_t i = 0; i < plan.messages.size(); ++i) {
    const PlannedMessage& m = plan.messages[i];
    v1::AppendRequest& r = out.emplace_back();
    if (i == 0 || m.repeat_ids) {
      r.set_pool(options_.pool);
      r.set_sequence(plan.sequence);
    }
    r.set_start(m.start);
    r.set_row_count(m.rows);
    r.set_dtype(m.dtype);
    for (const PlannedLayer& l : m.layers) FillLayer(l, r.add_layers());
    if (i == 0) {
      r.set_reserve_tokens(plan.reserve_tokens);
      if (plan.expect_length) r.set_expect_length(*plan.expect_length);
      r.set_view(plan.view);
    }
  }
  return out;
}

void AppendPlanner::ToBatchEntry(const StreamPlan& plan, v1::SequenceRows* out) const {
  const PlannedMessage& m = plan.messages.front();
  out->set_sequence(plan.sequence);
  out->set_start(m.start);
  out->set_row_count(m.rows);
  for (const PlannedLayer& l : m.layers) FillLayer(l, out->add_layers());
  if (plan.expect_length) out->set_expect_length(*plan.expect_length);
}

}  // namespace mlakv::soak
