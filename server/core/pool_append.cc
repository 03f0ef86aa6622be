// Pool: appends -- validation, page planning, staging, the deferred writes,
// commit and abort (pool.h "appends", docs/server.md "Atomicity").
#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "kernels/nvfp4_format.h"
#include "server/core/ids.h"
#include "server/core/pool.h"
#include "server/core/pool_internal.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {
namespace {

using format::kCkvDim;
using format::kCkvPackedBytes;
using format::kCkvSfBytes;
using format::kKpeBytes;
using format::kKpeDim;
using pool_internal::CeilDiv;
using pool_internal::Who;

const char* ShortDTypeName(DType d) { return d == DType::kFloat16 ? "fp16" : "bf16"; }

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// The page-table entries [first, last) that rows [start, start + count)
// land in (count > 0), cut at the `held` entries the table has.
struct EntryRange {
  size_t first = 0, last = 0;
};
EntryRange EntriesOfRows(uint32_t start, uint32_t count, int32_t page_size, size_t held) {
  const uint64_t end = static_cast<uint64_t>(start) + count;
  return {start / static_cast<size_t>(page_size),
          std::min<size_t>(held, static_cast<size_t>(CeilDiv(static_cast<int64_t>(end), page_size)))};
}

}  // namespace

// What Stage decides under the lock and carries to the writes outside it.
struct Pool::StagePlan {
  struct NewScales {
    float ckv_scale = 0.0f;
    float kpe_scale = 0.0f;
    size_t owner = 0;  // index of the transaction that named them (its Abort unsets them)
  };
  // [num_layers] the scales this call sets per layer (vectors, not maps: a
  // decode step looks each layer up once per sequence).
  std::vector<std::optional<NewScales>> new_scales;
  std::vector<int64_t> new_pages;           // [txns] pages each transaction needs beyond what it holds
  // [txns] page-table entries of existing pages the rows write that are
  // shared, to copy first (ascending; usually none).
  std::vector<std::vector<uint32_t>> cows;
  // [txns] page-table entries holding committed positions the rows rewrite.
  std::vector<AppendTransaction::PageRange> rewritten;
  int64_t total_new_pages = 0;              // tail pages and copies
  // The copies to make before the writes (from the shared page to the new one).
  std::vector<AppendTransaction::CopyOnWrite> copies;
  // The writes: per layer its segments, against one page table for the call
  // whose request i is transaction i's page-table entries that its rows land
  // in (none for a transaction without rows), so a segment's start counts
  // from the first of them.
  std::vector<std::vector<AppendSegment>> segments;  // [num_layers]
  std::vector<int32_t> kv_indptr{0}, kv_indices;
  std::vector<LayerAppend> appends;
  std::vector<AppendTransaction::Undo*> undo_to_capture;
  // The call's shared layers (SequenceRowsIn::shared_layers), checked with
  // the first sequence that names them.
  struct Shared {
    std::span<const LayerRows> layers;
    uint64_t rows = 0;            // rows each entry holds
    bool scales_checked = false;  // against the layers' state (once a sequence with rows passed)
  } shared;
  // When every sequence's rows lie back to back in the shared layers, in
  // call order: one segment per sequence, shared by all their LayerAppends
  // (instead of segments[layer] for each layer).
  std::vector<AppendSegment> shared_segments;
};

// ---- appends ---------------------------------------------------------------

absl::StatusOr<std::unique_ptr<AppendTransaction>> Pool::BeginAppend(const std::string& id) {
  absl::MutexLock lock(&mu_);
  return BeginLocked(id);
}

absl::Status Pool::BeginAppends(std::span<const std::string* const> ids,
                                std::vector<std::unique_ptr<AppendTransaction>>* out) {
  out->reserve(out->size() + ids.size());
  absl::MutexLock lock(&mu_);
  for (const std::string* id : ids) {
    MLAKV_ASSIGN_OR_RETURN(std::unique_ptr<AppendTransaction> txn, BeginLocked(*id));
    out->push_back(std::move(txn));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<AppendTransaction>> Pool::BeginLocked(const std::string& id) {
  if (id.empty()) return absl::InvalidArgumentError("sequence id is empty; name the sequence (e.g. the request id)");
  if (id.size() > kMaxSequenceIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("sequence id ", Quote(id), " is ", id.size(), " bytes; at most ",
                                                   kMaxSequenceIdBytes, " are accepted"));
  }
  Sequence* seq = sequences_.Find(id);
  bool created = false;
  if (seq == nullptr) {
    if (sequences_.size() >= options_.max_sequences) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "pool ", Quote(name()), " holds ", sequences_.size(), " sequences, its max_sequences; ", Who(id),
          " cannot be created. Free sequences, or configure a larger max_sequences"));
    }
    seq = sequences_.Add(std::string(id), NextId());
    created = true;
  } else if (seq->busy()) {
    return absl::AbortedError(absl::StrCat(Who(id), " of pool ", Quote(name()),
                                           " has another append in progress; retry when it has finished"));
  } else {
    sequences_.MarkBusy(seq);
  }
  std::unique_ptr<AppendTransaction> txn(new AppendTransaction(this, seq, std::string(id), options_.num_layers));
  txn->created_ = created;
  return txn;
}

absl::Status Pool::ValidateLayers(absl::FunctionRef<std::string()> who, std::span<const LayerRows> layers,
                                  uint64_t rows, DType dtype) const {
  std::vector<bool> seen(options_.num_layers, false);
  const int esize = DTypeSize(dtype);
  const uint64_t ckv_row = static_cast<uint64_t>(kCkvDim) * esize, kpe_row = static_cast<uint64_t>(kKpeDim) * esize;
  for (const LayerRows& lr : layers) {
    if (lr.layer < 0 || lr.layer >= options_.num_layers) {
      return absl::OutOfRangeError(absl::StrCat(who(), ": layer ", lr.layer, " is outside [0, ", options_.num_layers,
                                                ") of pool ", Quote(name())));
    }
    if (seen[lr.layer]) {
      return absl::InvalidArgumentError(
          absl::StrCat(who(), ": layer ", lr.layer, " appears twice in one message; send one entry per layer"));
    }
    seen[lr.layer] = true;
    if (lr.ckv_bytes != rows * ckv_row) {
      return absl::InvalidArgumentError(absl::StrCat(who(), " layer ", lr.layer, ": ckv bytes ", lr.ckv_bytes,
                                                     " is not rows(", rows, ") x ", ckv_row, " for ",
                                                     ShortDTypeName(dtype)));
    }
    if (lr.kpe_bytes != rows * kpe_row) {
      return absl::InvalidArgumentError(absl::StrCat(who(), " layer ", lr.layer, ": kpe bytes ", lr.kpe_bytes,
                                                     " is not rows(", rows, ") x ", kpe_row, " for ",
                                                     ShortDTypeName(dtype)));
    }
    // Scales: named (both set) or not (both 0).
    if (lr.ckv_scale != 0.0f || lr.kpe_scale != 0.0f) {
      for (auto [value, what] :
           {std::pair<float, const char*>{lr.ckv_scale, "ckv_scale"}, {lr.kpe_scale, "kpe_scale"}}) {
        if (absl::StatusOr<float> s = CheckDecodeScale(value, what); !s.ok()) {
          return absl::InvalidArgumentError(absl::StrCat(
              who(), " layer ", lr.layer, ": ", s.status().message(),
              value == 0.0f ? "; name both ckv_scale and kpe_scale, or neither to use the layer's" : ""));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Pool::ValidateShape(const std::string& id, const SequenceRowsIn& r, std::optional<DType> dtype,
                                 StagePlan& plan) const {
  const auto who = [&] { return Who(id); };  // built only for a message
  const std::span<const LayerRows> layers = r.written_layers();
  if (r.row_count > 0 && layers.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who(), ": row_count is ", r.row_count, " but no layers carry rows; add LayerRows entries"));
  }
  if (!layers.empty() && !dtype) {
    return absl::InvalidArgumentError(absl::StrCat(who(), ": dtype is unset; set ROW_DTYPE_FLOAT16 or ROW_DTYPE_BFLOAT16"));
  }
  if (!r.shared_layers.empty()) {
    StagePlan::Shared& shared = plan.shared;
    if (shared.layers.empty()) {  // the first sequence naming them: each entry holds the same whole number of rows
      shared.rows = r.shared_layers.front().ckv_bytes / (static_cast<uint64_t>(kCkvDim) * DTypeSize(*dtype));
      MLAKV_RETURN_IF_ERROR(
          ValidateLayers([] { return std::string("the call's shared layers"); }, r.shared_layers, shared.rows, *dtype));
      shared.layers = r.shared_layers;
    } else if (r.shared_layers.data() != shared.layers.data() || r.shared_layers.size() != shared.layers.size()) {
      return absl::InternalError("Pool::Stage: two different sets of shared layers in one call");
    }
    if (r.shared_first + r.row_count > shared.rows) {
      return absl::InvalidArgumentError(absl::StrCat(who(), ": rows [", r.shared_first, ", ",
                                                     r.shared_first + r.row_count, ") of the call's shared layers pass the ",
                                                     shared.rows, " rows they hold"));
    }
  } else if (!r.layers.empty()) {
    MLAKV_RETURN_IF_ERROR(ValidateLayers(who, r.layers, r.row_count, *dtype));
  }
  if (r.block_hashes.size() > static_cast<size_t>(options_.num_pages) ||
      static_cast<uint64_t>(r.block_hashes_first_page) + r.block_hashes.size() >
          static_cast<uint64_t>(options_.num_pages)) {
    return absl::InvalidArgumentError(absl::StrCat(who(), ": block hashes for page-table entries [",
                                                   r.block_hashes_first_page, ", ",
                                                   static_cast<uint64_t>(r.block_hashes_first_page) + r.block_hashes.size(),
                                                   ") pass the pool's ", options_.num_pages, " pages"));
  }
  for (size_t i = 0; i < r.block_hashes.size(); ++i) {
    if (r.block_hashes[i].empty() || r.block_hashes[i].size() > kMaxBlockHashBytes) {
      return absl::InvalidArgumentError(absl::StrCat(who(), ": block hash ", i, " is ", r.block_hashes[i].size(),
                                                     " bytes; each must be 1..", kMaxBlockHashBytes));
    }
  }
  // Byte counts first (they say what the message is), then where it lands.
  if (static_cast<uint64_t>(r.start) + r.row_count > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    return absl::OutOfRangeError(absl::StrCat(who(), ": start ", r.start, " + row_count ", r.row_count,
                                              " passes position 2^31 - 1 (positions are int32)"));
  }
  return absl::OkStatus();
}

absl::Status Pool::CheckState(size_t index, const AppendTransaction& txn, const SequenceRowsIn& r,
                              StagePlan& plan) const {
  const auto who = [&] { return Who(txn.id_); };  // built only for a message
  const std::span<const LayerRows> layers = r.written_layers();
  if (r.expect_generation) {
    if (txn.created_) {
      return absl::NotFoundError(absl::StrCat(who(), " not found in pool ", Quote(name()), "; expect_generation ",
                                              *r.expect_generation, " names an incarnation that no longer exists",
                                              " (nothing was written)"));
    }
    MLAKV_RETURN_IF_ERROR(CheckGeneration(*txn.sequence_, r.expect_generation));
  }
  if (const uint32_t protect = txn.sequence_->protected_tokens(); protect > 0 && r.row_count > 0 &&
                                                                   !layers.empty() && r.start < protect) {
    return absl::FailedPreconditionError(absl::StrCat(
        who(), ": rows [", r.start, ", ", static_cast<uint64_t>(r.start) + r.row_count, ") would rewrite tokens below ",
        protect, ", which ", txn.sequence_->lease_tokens().size(),
        " lease(s) protect; append at or after position ", protect, " or end the leases first (ListLeases)"));
  }
  // Every layer holding exactly expect_length tokens (a decode step) passes
  // without a look at each layer; otherwise each is checked to name the one
  // that differs.
  if (r.expect_length && !(txn.committed_min() == *r.expect_length && txn.committed_max() == *r.expect_length)) {
    // The layers these rows write, or the sequence as a whole.
    auto mismatch = [&](uint32_t have, const std::string& what) {
      return absl::FailedPreconditionError(absl::StrCat(
          who(), " ", what, " holds ", have, " tokens, not the ", *r.expect_length,
          " this append expects (expect_length); nothing was written. An earlier attempt of this append may "
          "have committed: read the sequence before retrying"));
    };
    if (layers.empty() && txn.committed_min() != *r.expect_length) return mismatch(txn.committed_min(), "");
    for (const LayerRows& lr : layers) {
      const uint32_t have = txn.committed(lr.layer);
      if (have != *r.expect_length) return mismatch(have, absl::StrCat("layer ", lr.layer));
    }
  }
  // Scales, per layer: once per call for shared layers (the same entries
  // meet the same state for every sequence).
  const bool shared = !r.shared_layers.empty();
  if (!shared || !plan.shared.scales_checked) {
    MLAKV_RETURN_IF_ERROR(CheckScales(index, txn, r, plan));
    if (shared && r.row_count > 0) plan.shared.scales_checked = true;
  }
  // No holes: start at or before what each layer holds (committed, or
  // staged by this same append); a start at or before the shortest layer's
  // committed length leaves none.
  if (r.row_count > 0 && r.start > txn.committed_min()) {
    for (const LayerRows& lr : layers) {
      const uint32_t have = std::max(txn.committed(lr.layer), txn.staged_end(lr.layer));
      if (r.start > have) {
        return absl::OutOfRangeError(absl::StrCat(who(), " layer ", lr.layer, ": start ", r.start,
                                                  " would leave a hole; the layer holds ", have,
                                                  " tokens, so an append must start at or before ", have));
      }
    }
  }
  return PlanPages(index, txn, r, plan);
}

absl::Status Pool::CheckScales(size_t index, const AppendTransaction& txn, const SequenceRowsIn& r,
                               StagePlan& plan) const {
  const auto who = [&] { return Who(txn.id_); };  // built only for a message
  for (const LayerRows& lr : r.written_layers()) {
    const int32_t layer = static_cast<int32_t>(lr.layer);
    const bool named = lr.ckv_scale != 0.0f || lr.kpe_scale != 0.0f;
    const LayerState& st = layers_[layer];
    if (const std::optional<StagePlan::NewScales>& decided = plan.new_scales[layer]; decided) {
      if (named && (!SameBits(lr.ckv_scale, decided->ckv_scale) || !SameBits(lr.kpe_scale, decided->kpe_scale))) {
        return absl::FailedPreconditionError(absl::StrCat(
            who(), " layer ", layer, ": names ckv_scale ", lr.ckv_scale, " kpe_scale ", lr.kpe_scale,
            " but another sequence of this call names ckv_scale ", decided->ckv_scale, " kpe_scale ",
            decided->kpe_scale, "; one layer has one pair of scales"));
      }
    } else if (st.scales_set) {
      if (named && (!SameBits(lr.ckv_scale, st.ckv_scale) || !SameBits(lr.kpe_scale, st.kpe_scale))) {
        // Empty means nothing readable under the old scales either: a freed
        // sequence kept for its lease, or pages a MatchPrefix lease holds (a
        // fork by hash can take them), are not in st.tokens but still read
        // with the layer's scales. So no lease at all, however conservative.
        const bool replaceable =
            !st.scales_from_config && st.tokens == 0 && st.staged_users == 0 && leases_.size() == 0;
        if (!replaceable) {
          return absl::FailedPreconditionError(absl::StrCat(
              who(), " layer ", layer, ": names ckv_scale ", lr.ckv_scale, " kpe_scale ", lr.kpe_scale, " but layer ",
              layer, " of pool ", Quote(name()), " has ckv_scale ", st.ckv_scale, " kpe_scale ", st.kpe_scale,
              st.scales_from_config ? " fixed by configuration"
              : st.tokens > 0 || st.staged_users > 0
                  ? absl::StrCat(" and stores ", st.tokens, " tokens (scales change only while a layer is empty)")
                  : absl::StrCat(" and ", leases_.size(),
                                 " leases may hold rows stored with them (scales change only while a layer is empty "
                                 "and the pool holds no lease)"),
              "; append with the layer's scales or leave them unset"));
        }
        plan.new_scales[layer] = StagePlan::NewScales{lr.ckv_scale, lr.kpe_scale, index};
      }
    } else if (named) {
      plan.new_scales[layer] = StagePlan::NewScales{lr.ckv_scale, lr.kpe_scale, index};
    } else if (r.row_count > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          who(), " layer ", layer, ": layer ", layer, " of pool ", Quote(name()),
          " has no scales yet; name ckv_scale and kpe_scale in the first append to it (or configure them)"));
    }
  }
  return absl::OkStatus();
}

absl::Status Pool::PlanPages(size_t index, const AppendTransaction& txn, const SequenceRowsIn& r,
                             StagePlan& plan) const {
  const auto who = [&] { return Who(txn.id_); };  // built only for a message
  const std::span<const LayerRows> layers = r.written_layers();
  // Capacity this sequence needs (checked for the whole call afterwards).
  const uint64_t end = static_cast<uint64_t>(r.start) + r.row_count;
  const uint64_t needed_tokens = std::max<uint64_t>(r.row_count == 0 || layers.empty() ? 0 : end, r.reserve_tokens);
  if (needed_tokens > static_cast<uint64_t>(max_tokens_)) {
    return absl::ResourceExhaustedError(absl::StrCat(who(), " would need ", needed_tokens, " tokens but pool ",
                                                     Quote(name()), " holds at most ", max_tokens_, " (",
                                                     options_.num_pages, " pages of ", options_.page_size,
                                                     "); nothing was written"));
  }
  const int64_t pages_needed = CeilDiv(static_cast<int64_t>(needed_tokens), options_.page_size);
  plan.new_pages[index] = std::max<int64_t>(0, pages_needed - static_cast<int64_t>(txn.sequence_->pages().size()));
  plan.total_new_pages += plan.new_pages[index];
  // Existing pages the rows write; the shared ones are copied first.
  if (r.row_count > 0 && !layers.empty()) {
    const std::vector<int32_t>& pages = txn.sequence_->pages();
    const auto [first, last] = EntriesOfRows(r.start, r.row_count, options_.page_size, pages.size());
    for (size_t i = first; i < last; ++i) {
      if (allocator_->refs(pages[i]) > 1) plan.cows[index].push_back(static_cast<uint32_t>(i));
    }
    // Pages holding committed positions the rows rewrite: their hashes go.
    // Rows starting at or past every layer's end rewrite nothing.
    uint64_t rewrite_end = 0;
    if (r.start < txn.committed_max()) {
      for (const LayerRows& lr : layers) {
        rewrite_end = std::max<uint64_t>(rewrite_end, std::min<uint64_t>(end, txn.committed(lr.layer)));
      }
    }
    if (rewrite_end > r.start) {
      plan.rewritten[index] = {static_cast<uint32_t>(first),
                               static_cast<uint32_t>(CeilDiv(static_cast<int64_t>(rewrite_end), options_.page_size))};
    }
    plan.total_new_pages += static_cast<int64_t>(plan.cows[index].size());
  }
  return absl::OkStatus();
}

void Pool::Reserve(std::span<AppendTransaction* const> txns, StagePlan& plan) {
  std::vector<int32_t> pages = *allocator_->Allocate(plan.total_new_pages);  // MakeRoom passed under this lock
  size_t next = 0;
  for (size_t i = 0; i < txns.size(); ++i) {
    AppendTransaction& txn = *txns[i];
    Sequence* seq = txn.sequence_;
    // Copy-on-write: a new page takes the shared one's place; the append
    // keeps the shared page's reference until Commit.
    for (uint32_t index : plan.cows[i]) {
      const int32_t to = pages[next++];
      const int32_t from = sequences_.ReplacePage(seq, index, to);
      ++cow_held_[from];
      seq->set_cow_in_flight(true);
      txn.cows_.push_back({.index = index, .from = from, .to = to});
      plan.copies.push_back(txn.cows_.back());
    }
    // A private page being rewritten no longer holds what its hash says.
    const AppendTransaction::PageRange& rw = plan.rewritten[i];
    for (uint32_t index = rw.first; index < rw.last; ++index) {
      if (!std::binary_search(plan.cows[i].begin(), plan.cows[i].end(), index)) {
        prefix_.ErasePage(seq->pages()[index]);
      }
    }
    if (rw.last > rw.first) txn.rewritten_pages_.push_back(rw);
    sequences_.AttachPages(seq, std::span<const int32_t>(pages.data() + next, plan.new_pages[i]));
    next += plan.new_pages[i];
    txn.pages_allocated_ += static_cast<uint32_t>(plan.new_pages[i] + plan.cows[i].size());
  }
  for (int32_t layer = 0; layer < static_cast<int32_t>(plan.new_scales.size()); ++layer) {
    if (!plan.new_scales[layer]) continue;
    const StagePlan::NewScales& scales = *plan.new_scales[layer];
    LayerState& st = layers_[layer];
    txns[scales.owner]->scales_before_.push_back(
        {.layer = layer, .set = st.scales_set, .ckv_scale = st.ckv_scale, .kpe_scale = st.kpe_scale});
    st.scales_set = true;
    st.ckv_scale = scales.ckv_scale;
    st.kpe_scale = scales.kpe_scale;
  }
}

void Pool::PlanWrites(std::span<AppendTransaction* const> txns, std::span<const SequenceRowsIn* const> rows,
                      std::optional<DType> dtype, StagePlan& plan) {
  const int esize = DTypeSize(dtype.value_or(DType::kBFloat16));
  // One placement for all layers when every sequence with rows reads them
  // from the shared layers, back to back in call order (the compact form):
  // the row offset of the first of them, else unset.
  const std::optional<uint64_t> shared_from = [&]() -> std::optional<uint64_t> {
    std::optional<uint64_t> from;
    uint64_t next = 0;
    for (const SequenceRowsIn* r : rows) {
      if (r->row_count == 0) continue;
      if (r->shared_layers.empty()) return std::nullopt;
      if (!from) from = next = r->shared_first;
      if (r->shared_first != next) return std::nullopt;
      next += r->row_count;
    }
    return from;
  }();
  if (shared_from) plan.shared_segments.reserve(txns.size());
  int32_t touched_every_layer = 0;  // transactions whose layers were all marked at once
  for (size_t i = 0; i < txns.size(); ++i) {
    AppendTransaction& txn = *txns[i];
    const SequenceRowsIn& r = *rows[i];
    const Sequence& seq = *txn.sequence_;
    const std::span<const LayerRows> written = r.written_layers();
    // The backend's page table for this request is only the entries the
    // rows land in, and the segment's start counts from the first of them:
    // a decode step at 16k tokens of context would otherwise hand over (and
    // a device backend copy to the GPU) 256 entries per sequence every step
    // to write one row in one page.
    const EntryRange entries = r.row_count == 0 || written.empty()
                                   ? EntryRange{}
                                   : EntriesOfRows(r.start, r.row_count, options_.page_size, seq.pages().size());
    plan.kv_indices.insert(plan.kv_indices.end(), seq.pages().begin() + entries.first,
                           seq.pages().begin() + entries.last);
    plan.kv_indptr.push_back(static_cast<int32_t>(plan.kv_indices.size()));
    if (r.row_count == 0) continue;
    const AppendSegment segment{.rows = {},
                                .count = static_cast<int32_t>(r.row_count),
                                .request = static_cast<int32_t>(i),
                                .start = static_cast<int32_t>(r.start - entries.first * options_.page_size)};
    if (shared_from) plan.shared_segments.push_back(segment);
    const bool may_rewrite = r.start < txn.committed_max();
    // The call's shared rows for every layer (validated distinct, so all of
    // them), nothing rewritten, and a transaction that touched no layer yet
    // (a decode step): all its layers are marked at once, and each layer's
    // staged users counted once for the call below, not once per pair.
    if (shared_from && !may_rewrite && txn.touched_layers_ == 0 &&
        written.size() == static_cast<size_t>(options_.num_layers)) {
      txn.TouchEveryLayer();
      ++touched_every_layer;
      continue;
    }
    for (const LayerRows& lr : written) {
      const int32_t l = static_cast<int32_t>(lr.layer);
      if (txn.Touch(l)) ++layers_[l].staged_users;
      if (!shared_from) {
        std::vector<AppendSegment>& segments = plan.segments[l];
        if (segments.empty()) segments.reserve(txns.size());
        segments.push_back(segment);
        segments.back().rows = r.shared_layers.empty() ? lr.source : lr.source.From(r.shared_first, esize);
      }
      // Committed positions these rows rewrite whose old bytes are not saved yet.
      if (!may_rewrite) continue;
      const uint32_t rewrite_end = std::min<uint64_t>(static_cast<uint64_t>(r.start) + r.row_count, txn.committed(l));
      if (r.start < rewrite_end) {
        // Before the write: a lease taken meanwhile must not cover it.
        txn.sequence_->set_rewrite_floor(std::min(txn.sequence_->rewrite_floor(), r.start));
        if (txn.saved_.empty()) txn.saved_.resize(options_.num_layers);
        std::vector<bool>& saved = txn.saved_[l];
        if (saved.empty()) saved.assign(txn.committed(l), false);
        AppendTransaction::Undo undo;
        undo.layer = l;
        for (uint32_t p = r.start; p < rewrite_end; ++p) {
          if (saved[p]) continue;
          saved[p] = true;
          undo.entries.push_back(EntryOf(seq, p));
        }
        if (!undo.entries.empty()) txn.undo_.push_back(std::move(undo));
      }
    }
  }
  if (touched_every_layer > 0) {
    for (LayerState& st : layers_) st.staged_users += touched_every_layer;
  }
  // Pointers into undo_ stay valid: nothing else appends to it before the
  // capture, and only this worker touches it.
  for (AppendTransaction* txn : txns) {
    for (AppendTransaction::Undo& u : txn->undo_) {
      if (!u.captured) plan.undo_to_capture.push_back(&u);
    }
  }
  if (shared_from) {
    for (const LayerRows& lr : plan.shared.layers) {
      const LayerState& st = layers_[lr.layer];
      plan.appends.push_back({.layer = lr.layer,
                              .dtype = dtype.value_or(DType::kBFloat16),
                              .ckv_scale = st.ckv_scale,
                              .kpe_scale = st.kpe_scale,
                              .segments = plan.shared_segments,
                              .rows = lr.source.From(*shared_from, esize),
                              .kv_indptr = plan.kv_indptr,
                              .kv_indices = plan.kv_indices});
    }
    return;
  }
  for (int32_t layer = 0; layer < static_cast<int32_t>(plan.segments.size()); ++layer) {
    const std::vector<AppendSegment>& segments = plan.segments[layer];
    if (segments.empty()) continue;
    const LayerState& st = layers_[layer];
    plan.appends.push_back({.layer = layer,
                            .dtype = dtype.value_or(DType::kBFloat16),
                            .ckv_scale = st.ckv_scale,
                            .kpe_scale = st.kpe_scale,
                            .segments = segments,
                            .rows = std::nullopt,
                            .kv_indptr = plan.kv_indptr,
                            .kv_indices = plan.kv_indices});
  }
}

absl::Status Pool::CaptureUndo(const StagePlan& plan) {
  // Copies first: the undo of a rewritten position in a copied page reads
  // the copy.
  for (const AppendTransaction::CopyOnWrite& c : plan.copies) {
    MLAKV_RETURN_IF_ERROR(CopyPage(c.from, c.to, static_cast<uint32_t>(options_.page_size)));
  }
  for (AppendTransaction::Undo* u : plan.undo_to_capture) {
    const size_t n = u->entries.size();
    u->ckv_packed.resize(n * kCkvPackedBytes);
    u->ckv_sf.resize(n * kCkvSfBytes);
    u->kpe.resize(n * kKpeBytes);
    if (absl::Status s =
            backend_->ReadEntries(u->layer, u->entries, {u->ckv_packed.data(), u->ckv_sf.data(), u->kpe.data()});
        !s.ok()) {
      return s;
    }
    u->captured = true;
  }
  return absl::OkStatus();
}

void Pool::RecordStaged(std::span<AppendTransaction* const> txns, std::span<const SequenceRowsIn* const> rows) {
  for (size_t i = 0; i < txns.size(); ++i) {
    AppendTransaction& txn = *txns[i];
    const SequenceRowsIn& r = *rows[i];
    for (size_t h = 0; h < r.block_hashes.size(); ++h) {
      txn.hashes_[r.block_hashes_first_page + static_cast<uint32_t>(h)] = r.block_hashes[h];
    }
    if (r.pin) txn.pin_ = true;
    if (r.row_count == 0) continue;
    const std::span<const LayerRows> layers = r.written_layers();
    const uint32_t end = r.start + r.row_count;
    if (layers.size() == static_cast<size_t>(options_.num_layers)) {
      txn.StageEveryLayer(end);  // every layer (validated distinct)
    } else {
      for (const LayerRows& lr : layers) txn.StageLayer(static_cast<int32_t>(lr.layer), end);
    }
    txn.rows_written_ += static_cast<uint64_t>(r.row_count) * layers.size();
  }
}

absl::Status Pool::Stage(std::span<AppendTransaction* const> txns, std::span<const SequenceRowsIn* const> rows,
                         std::optional<DType> dtype, DeferredWrites* deferred) {
  if (txns.size() != rows.size()) return absl::InternalError("Pool::Stage: txns and rows differ in length");
  for (size_t i = 0; i < txns.size(); ++i) {
    if (txns[i]->finished_) return absl::InternalError("Pool::Stage on a finished transaction");
  }
  StagePlan plan;
  for (size_t i = 0; i < txns.size(); ++i) MLAKV_RETURN_IF_ERROR(ValidateShape(txns[i]->id_, *rows[i], dtype, plan));
  plan.new_scales.resize(options_.num_layers);
  plan.segments.resize(options_.num_layers);
  plan.new_pages.assign(txns.size(), 0);
  plan.cows.resize(txns.size());
  plan.rewritten.resize(txns.size());
  {
    absl::MutexLock lock(&mu_);
    ReapExpiredLeases();  // a lease past its expiry protects nothing
    for (size_t i = 0; i < txns.size(); ++i) {
      MLAKV_RETURN_IF_ERROR(CheckState(i, *txns[i], *rows[i], plan));
    }
    MLAKV_RETURN_IF_ERROR(MakeRoom(plan.total_new_pages, "this append"));
    Reserve(txns, plan);
    PlanWrites(txns, rows, dtype, plan);
  }
  // Save what will be rewritten, then write (outside mu_; only this worker
  // touches the caches) -- or hold the write back for Flush.
  const bool hold = deferred != nullptr && plan.copies.empty() && plan.undo_to_capture.empty() &&
                    std::all_of(plan.appends.begin(), plan.appends.end(),
                                [](const LayerAppend& la) { return ContiguousDeviceRows(la).has_value(); });
  if (deferred != nullptr && !deferred->empty() && (!hold || deferred->Names(plan.appends))) {
    MLAKV_RETURN_IF_ERROR(Flush(*deferred));
  }
  MLAKV_RETURN_IF_ERROR(CaptureUndo(plan));
  if (hold) {
    deferred->Hold(plan);
  } else {
    MLAKV_RETURN_IF_ERROR(backend_->Append(plan.appends));
  }
  absl::MutexLock lock(&mu_);
  RecordStaged(txns, rows);
  return absl::OkStatus();
}

absl::Status Pool::Flush(DeferredWrites& deferred) {
  if (deferred.empty()) return absl::OkStatus();
  const absl::Status s = backend_->Append(deferred.appends_);
  deferred.Clear();
  return s;
}

// ---- Pool::DeferredWrites ------------------------------------------------------

// One Stage's placement and page table, moved out of its plan: moving a
// vector keeps its buffer, so the held LayerAppends' spans stay valid.
struct Pool::DeferredWrites::Held {
  std::vector<std::vector<AppendSegment>> segments;
  std::vector<AppendSegment> shared_segments;
  std::vector<int32_t> kv_indptr, kv_indices;
};

Pool::DeferredWrites::DeferredWrites() = default;
Pool::DeferredWrites::~DeferredWrites() = default;

void Pool::DeferredWrites::Clear() {
  appends_.clear();
  held_.clear();
}

std::vector<const void*> Pool::DeferredWrites::WaitEvents() const {
  std::vector<const void*> out;
  auto add = [&out](const RowSource& rows) {
    for (const void* ev : rows.wait_events) {
      if (ev != nullptr && std::find(out.begin(), out.end(), ev) == out.end()) out.push_back(ev);
    }
  };
  for (const LayerAppend& la : appends_) {
    if (la.rows) {
      add(*la.rows);
    } else {
      for (const AppendSegment& seg : la.segments) add(seg.rows);
    }
  }
  return out;
}

bool Pool::DeferredWrites::HoldsEveryLayer(int32_t num_layers) const {
  if (num_layers <= 0 || appends_.size() < static_cast<size_t>(num_layers)) return false;
  std::vector<bool> held(num_layers, false);
  int32_t distinct = 0;
  for (const LayerAppend& la : appends_) {
    if (la.layer >= 0 && la.layer < num_layers && !held[la.layer]) {
      held[la.layer] = true;
      ++distinct;
    }
  }
  return distinct == num_layers;
}

bool Pool::DeferredWrites::Names(std::span<const LayerAppend> appends) const {
  for (const LayerAppend& a : appends) {
    for (const LayerAppend& h : appends_) {
      if (a.layer == h.layer) return true;
    }
  }
  return false;
}

void Pool::DeferredWrites::Hold(StagePlan& plan) {
  if (plan.appends.empty()) return;
  held_.push_back(std::make_unique<Held>(Held{.segments = std::move(plan.segments),
                                              .shared_segments = std::move(plan.shared_segments),
                                              .kv_indptr = std::move(plan.kv_indptr),
                                              .kv_indices = std::move(plan.kv_indices)}));
  appends_.insert(appends_.end(), plan.appends.begin(), plan.appends.end());
}

SequenceSnapshot Pool::Commit(AppendTransaction& txn) {
  const int64_t now = NowNs();
  LayerTally tally(options_.num_layers);
  absl::MutexLock lock(&mu_);
  SequenceSnapshot snapshot = CommitLocked(txn, now, tally);
  ApplyLocked(tally);
  return snapshot;
}

std::vector<SequenceSnapshot> Pool::Commit(std::span<AppendTransaction* const> txns, SnapshotPages pages) {
  std::vector<SequenceSnapshot> out;
  out.reserve(txns.size());
  const int64_t now = NowNs();  // one use time for the call's sequences
  LayerTally tally(options_.num_layers);
  absl::MutexLock lock(&mu_);
  for (AppendTransaction* txn : txns) out.push_back(CommitLocked(*txn, now, tally, pages));
  ApplyLocked(tally);
  return out;
}

void Pool::ApplyLocked(const LayerTally& tally) {
  for (int32_t l = 0; l < options_.num_layers; ++l) {
    layers_[l].tokens += tally.tokens[l] + tally.tokens_of_every_layer;
    layers_[l].staged_users -= static_cast<int32_t>(tally.users[l] + tally.users_of_every_layer);
  }
}

SequenceSnapshot Pool::CommitLocked(AppendTransaction& txn, int64_t now_ns, LayerTally& tally, SnapshotPages pages) {
  Sequence& seq = *txn.sequence_;
  // A layer the append did not touch has a staged end of 0, so it keeps its
  // length and adds no tokens. Rows ending at the same place in every layer
  // of a sequence whose layers are level (a decode step) raise them all in
  // one step.
  if (txn.level_end_ && seq.length() == seq.max_length()) {
    tally.tokens_of_every_layer += seq.RaiseLevelLengths(*txn.level_end_);
  } else {
    seq.RaiseLengths(txn.staged_ends(), tally.tokens);
  }
  if (txn.touched_every_layer()) {
    ++tally.users_of_every_layer;  // every layer written (a decode step)
  } else if (txn.touched_layers_ > 0) {
    for (int32_t l = 0; l < options_.num_layers; ++l) tally.users[l] += txn.touched_[l];
  }
  txn.undo_.clear();
  txn.finished_ = true;
  seq.set_rewrite_floor(UINT32_MAX);
  // The copies are in place: the shared pages lose this sequence's
  // reference, unless they hold tokens a lease protects (a reader may attend
  // from the page table it leased, which names them): the leases keep those.
  const int64_t protected_pages = CeilDiv(seq.protected_tokens(), options_.page_size);
  for (const AppendTransaction::CopyOnWrite& c : txn.cows_) {
    if (--cow_held_[c.from] == 0) cow_held_.erase(c.from);
    if (static_cast<int64_t>(c.index) < protected_pages) {
      seq.lease_held_pages().push_back(c.from);
    } else {
      ReleasePages(std::span<const int32_t>(&c.from, 1));
    }
  }
  seq.set_cow_in_flight(false);
  counters_.pages_copied += txn.cows_.size();
  // Hashes: rewritten pages lose their pending ones; the new ones wait until
  // their page is complete in every layer.
  std::map<uint32_t, std::string>& pending = seq.pending_hashes();
  for (const AppendTransaction::PageRange& rw : txn.rewritten_pages_) {
    if (!pending.empty()) pending.erase(pending.lower_bound(rw.first), pending.lower_bound(rw.last));
  }
  for (auto& [index, hash] : txn.hashes_) seq.pending_hashes()[index] = std::move(hash);
  // KV events: rewritten announced pages are withdrawn (their bytes
  // changed), then every page complete now and not announced is.
  for (const AppendTransaction::PageRange& rw : txn.rewritten_pages_) WithdrawPages(&seq, rw.first, rw.last, "rewrite");
  AnnounceStoredPages(&seq);
  IndexCompletePages(&seq);
  if (txn.created_) {
    ended_.Forget(seq.id());
    if (txn.pin_) sequences_.SetPinned(&seq);
  }
  SequenceSnapshot snapshot =
      SnapshotOf(seq, /*count_shared=*/false,
                 pages == SnapshotPages::kNew    ? std::optional<size_t>(txn.first_changed_page())
                 : pages == SnapshotPages::kNone ? std::optional<size_t>(seq.pages().size())
                                                 : std::nullopt);
  if (txn.created_ && seq.empty()) {
    // Nothing written and nothing reserved: a new id is not kept (an append
    // of zero rows must not leave a sequence behind), and has no generation.
    sequences_.Erase(&seq);
    snapshot.generation = 0;
    return snapshot;
  }
  sequences_.SetCommitted(&seq);
  sequences_.MarkIdle(&seq, now_ns);
  return snapshot;
}

void Pool::Abort(AppendTransaction& txn) {
  AppendTransaction* one[] = {&txn};
  Abort(one);
}

void Pool::Abort(std::span<AppendTransaction* const> txns) {
  // Reverse order: a later transaction's changes are undone before an
  // earlier one's. (One committed or aborted before is left alone.)
  std::vector<AppendTransaction*> undone;
  undone.reserve(txns.size());
  for (auto it = txns.rbegin(); it != txns.rend(); ++it) {
    if ((*it)->finished_) continue;
    AbortOne(**it);
    undone.push_back(*it);
  }
  // Scales last, once every transaction of the call has left the layers: the
  // one that set a layer's scales puts the old ones back only while no
  // append has rows staged there, and another sequence of the same call had
  // until its own abort above (restoring in the same pass as that abort
  // left a failed call's new scales in place).
  absl::MutexLock lock(&mu_);
  for (AppendTransaction* txn : undone) {
    for (auto s = txn->scales_before_.rbegin(); s != txn->scales_before_.rend(); ++s) {
      LayerState& st = layers_[s->layer];
      if (st.tokens == 0 && st.staged_users == 0) {
        st.scales_set = s->set;
        st.ckv_scale = s->ckv_scale;
        st.kpe_scale = s->kpe_scale;
      }
    }
    txn->scales_before_.clear();
  }
}

void Pool::AbortOne(AppendTransaction& txn) {
  // Put back the bytes of rewritten committed positions. The sequence is
  // still held (busy), so its pages cannot have changed hands.
  for (const AppendTransaction::Undo& u : txn.undo_) {
    if (!u.captured) continue;
    if (absl::Status s = backend_->WriteEntries(
            u.layer, u.entries,
            {const_cast<uint8_t*>(u.ckv_packed.data()), const_cast<uint8_t*>(u.ckv_sf.data()),
             const_cast<uint8_t*>(u.kpe.data())});
        !s.ok()) {
      spdlog::error("pool {}: restoring {} rewritten rows of {} layer {} failed: {}", Quote(name()), u.entries.size(),
                    Who(txn.id_), u.layer, std::string(s.message()));
    }
  }
  txn.undo_.clear();
  absl::MutexLock lock(&mu_);
  Sequence* seq = txn.sequence_;
  for (int32_t l = 0; l < options_.num_layers; ++l) {
    if (txn.touched(l)) --layers_[l].staged_users;
  }
  // The shared pages go back where the copies were.
  for (auto it = txn.cows_.rbegin(); it != txn.cows_.rend(); ++it) {
    sequences_.ReplacePage(seq, it->index, it->from);
    if (--cow_held_[it->from] == 0) cow_held_.erase(it->from);
    ReleasePages(std::span<const int32_t>(&it->to, 1));
  }
  txn.cows_.clear();
  seq->set_cow_in_flight(false);
  seq->set_rewrite_floor(UINT32_MAX);
  std::vector<int32_t> cut = sequences_.DetachTail(seq, txn.original_pages_);
  ReleasePages(cut);
  if (txn.created_) {
    sequences_.Erase(seq);
  } else {
    sequences_.MarkIdle(seq, NowNs());  // an attempted append is a use too
  }
  txn.finished_ = true;
}

}  // namespace mlakv::server
