#include "server/core/pool.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "kernels/nvfp4_format.h"
#include "kernels/quantize_append.h"
#include "server/backend/backend_factory.h"
#include "server/core/ids.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {
namespace {

using format::kCkvDim;
using format::kCkvPackedBytes;
using format::kCkvSfBytes;
using format::kKpeBytes;
using format::kKpeDim;

const char* ShortDTypeName(DType d) { return d == DType::kFloat16 ? "fp16" : "bf16"; }

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

// "sequence 'id'" for messages, with the id quoted safely (common/quote.h).
std::string Who(const std::string& id) { return absl::StrCat("sequence ", Quote(id)); }

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

// ---- Pool --------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Pool>> Pool::Create(const Options& options) {
  const std::string where = absl::StrCat("pool ", Quote(options.name), ": ");
  if (options.name.empty()) return absl::InvalidArgumentError("pool name is empty");
  if (options.num_layers < 1 || options.page_size < 1 || options.num_pages < 1) {
    return absl::InvalidArgumentError(absl::StrCat(where, "num_layers, page_size and num_pages must be >= 1, got ",
                                                   options.num_layers, ", ", options.page_size, ", ",
                                                   options.num_pages));
  }
  if (options.max_sequences < 1) return absl::InvalidArgumentError(absl::StrCat(where, "max_sequences must be >= 1"));
  const Options::Eviction& ev = options.eviction;
  if (ev.high_watermark != 0.0 &&
      (!ev.lru || !(ev.high_watermark > 0.0 && ev.high_watermark <= 1.0) ||
       !(ev.low_watermark >= 0.0 && ev.low_watermark < ev.high_watermark))) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "eviction watermarks need the lru policy and 0 <= low < high <= 1, got high ", ev.high_watermark,
        " low ", ev.low_watermark));
  }
  if (options.max_leases < 1 || options.max_leases_per_sequence < 1 ||
      options.default_lease_duration <= absl::ZeroDuration() ||
      options.max_lease_duration < options.default_lease_duration) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, "max_leases and max_leases_per_sequence must be >= 1 and 0 < default lease duration <= max"));
  }
  if (static_cast<int64_t>(options.num_pages) * options.page_size > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(where, "num_pages x page_size = ",
                                                   static_cast<int64_t>(options.num_pages) * options.page_size,
                                                   " tokens exceeds 2^31 - 1 (positions are int32)"));
  }
  if (!options.layer_scales.empty() && static_cast<int32_t>(options.layer_scales.size()) != options.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(where, "layer_scales has ", options.layer_scales.size(),
                                                   " entries, expected num_layers = ", options.num_layers));
  }
  for (size_t l = 0; l < options.layer_scales.size(); ++l) {
    if (!options.layer_scales[l]) continue;
    for (auto [value, what] : {std::pair<float, const char*>{options.layer_scales[l]->ckv_scale, "ckv_scale"},
                               {options.layer_scales[l]->kpe_scale, "kpe_scale"}}) {
      if (absl::StatusOr<float> s = CheckDecodeScale(value, what); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(where, "layer ", l, ": ", s.status().message()));
      }
    }
  }
  MLAKV_ASSIGN_OR_RETURN(std::unique_ptr<PageAllocator> allocator, PageAllocator::Create({.num_pages = options.num_pages}));
  absl::StatusOr<std::unique_ptr<CacheBackend>> backend = CreateCacheBackend(
      options.device,
      {.num_layers = options.num_layers, .num_pages = options.num_pages, .page_size = options.page_size},
      {.source_timeout = options.source_timeout});
  if (!backend.ok()) {
    return absl::Status(backend.status().code(), absl::StrCat(where, backend.status().message()));
  }
  if (options.wrap_backend) *backend = options.wrap_backend(std::move(*backend));  // operations: metrics
  return std::unique_ptr<Pool>(new Pool(options, std::move(*backend), std::move(allocator)));
}

Pool::Pool(const Options& options, std::unique_ptr<CacheBackend> backend, std::unique_ptr<PageAllocator> allocator)
    : options_(options),
      device_(options.device),
      max_tokens_(static_cast<int64_t>(options.num_pages) * options.page_size),
      backend_(std::move(backend)),
      allocator_(std::move(allocator)),
      sequences_(options.num_layers, options.num_pages),
      layers_(options.num_layers),
      prefix_(options.num_pages),
      ended_(options.eviction.remember_ended),
      page_stored_(options.num_pages, 0),
      // The worker makes the pool's GPU current once, before its first task.
      waiter_(std::make_unique<SourceWaiter>(backend_.get(), [device = device_] { device.BindThread(); })),
      worker_(std::make_unique<SerialExecutor>([device = device_] { device.BindThread(); })) {
  for (size_t l = 0; l < options.layer_scales.size(); ++l) {
    if (!options.layer_scales[l]) continue;
    LayerState& st = layers_[l];
    st.scales_set = true;
    st.scales_from_config = true;
    st.ckv_scale = options.layer_scales[l]->ckv_scale;
    st.kpe_scale = options.layer_scales[l]->kpe_scale;
  }
}

Pool::~Pool() {
  waiter_.reset();  // cancels what waits; the callbacks post to the worker, which then drains
  worker_.reset();
}

absl::StatusOr<bool> Pool::WaitForSourcesHere(std::span<const void* const> events, const WaitLimits& limits) {
  if (events.empty()) return true;  // nothing held by reference behind an event (most commits)
  while (true) {
    MLAKV_ASSIGN_OR_RETURN(const bool complete, backend_->EventsComplete(events));
    if (complete) return true;
    if (worker_->pending() > 1) return false;  // the caller's task and one queued behind it
    if (absl::Now() >= limits.deadline) return SourcesLateError();
    if (limits.Abandoned()) return SourcesAbandonedError();
    std::this_thread::yield();
  }
}

absl::StatusOr<bool> Pool::SourcesComplete(std::span<const void* const> events) {
  if (events.empty()) return true;
  return backend_->EventsComplete(events);
}

bool Pool::WhenSourcesComplete(std::vector<const void*> events, WaitLimits limits, SourceWaiter::Done done) {
  if (events.empty()) return false;
  if (absl::StatusOr<bool> complete = SourcesComplete(events); complete.ok() && *complete) return false;
  waiter_->Wait(std::move(events), std::move(limits), std::move(done));  // a failed query fails there, with its status
  return true;
}

int64_t Pool::EntryOf(const Sequence& seq, uint32_t position) const {
  const int32_t page = seq.pages()[position / options_.page_size];
  return static_cast<int64_t>(page) * options_.page_size + position % options_.page_size;
}

int64_t Pool::NowNs() const { return absl::ToUnixNanos(options_.clock ? options_.clock() : absl::Now()); }

uint32_t Pool::ReleasePages(std::span<const int32_t> pages, const char* reason, const std::string& sequence) {
  std::vector<int32_t> freed;
  freed.reserve(pages.size());
  if (absl::Status s = allocator_->Unref(pages, &freed); !s.ok()) {
    spdlog::error("pool {}: {}", Quote(name()), std::string(s.message()));  // a bug; the pages stay used rather than corrupt the list
  }
  // The freed pages that were announced stored: one removed event. Its
  // vectors are sized once and the hashes listed only from the first page
  // that has one (earlier pages then get empty strings): freeing a 262k-token
  // sequence grew two vectors page by page, 4,096 string slots of them
  // empty, which took most of the call's ~455 us on the development VM
  // (docs/performance.md "Freeing a long sequence").
  KvEvent removed;
  removed.pages.reserve(pages.size());
  const auto withdraw = [&](int32_t page) {
    page_stored_[page] = 0;
    removed.pages.push_back(page);
    const std::string* hash = prefix_.HashOf(page);
    if (hash != nullptr && removed.block_hashes.empty()) {
      removed.block_hashes.reserve(pages.size());
      removed.block_hashes.resize(removed.pages.size() - 1);
    }
    if (!removed.block_hashes.empty() || hash != nullptr) {
      removed.block_hashes.push_back(hash == nullptr ? std::string() : *hash);
    }
  };
  for (int32_t page : freed) {
    if (page_stored_[page]) withdraw(page);
    prefix_.ErasePage(page);
  }
  // A stored page that stays allocated but that no remaining holder has
  // complete (a truncation cut into it while it was shared, and the holder
  // that had it complete let go now): nothing claims those bytes any more
  // and the next append writes over them in place, so they go now. A page
  // a lease (or an in-flight copy) also references keeps them.
  for (int32_t page : pages) {
    if (!page_stored_[page] || allocator_->refs(page) == 0) continue;
    const SequenceTable::Holders& holders = sequences_.HoldersOf(page);
    if (holders.size() != static_cast<size_t>(allocator_->refs(page))) continue;
    const bool claimed = std::any_of(holders.begin(), holders.end(), [&](const SequenceTable::Owner& o) {
      return o.page_index < o.sequence->length() / static_cast<uint32_t>(options_.page_size);
    });
    if (!claimed) {
      withdraw(page);
      prefix_.ErasePage(page);
    }
  }
  if (!removed.pages.empty()) {
    removed.kind = KvEvent::Kind::kRemoved;
    removed.sequence = sequence;
    removed.reason = reason;
    RecordEvent(std::move(removed));
  }
  return static_cast<uint32_t>(freed.size());
}

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
        const bool replaceable = !st.scales_from_config && st.tokens == 0 && st.staged_users == 0;
        if (!replaceable) {
          return absl::FailedPreconditionError(absl::StrCat(
              who(), " layer ", layer, ": names ckv_scale ", lr.ckv_scale, " kpe_scale ", lr.kpe_scale, " but layer ",
              layer, " of pool ", Quote(name()), " has ckv_scale ", st.ckv_scale, " kpe_scale ", st.kpe_scale,
              st.scales_from_config
                  ? " fixed by configuration"
                  : absl::StrCat(" and stores ", st.tokens, " tokens (scales change only while a layer is empty)"),
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
                 pages == SnapshotPages::kNew    ? std::optional<size_t>(txn.original_pages_)
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
  if (txn.finished_) return;
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
  for (auto it = txn.scales_before_.rbegin(); it != txn.scales_before_.rend(); ++it) {
    LayerState& st = layers_[it->layer];
    if (st.tokens == 0 && st.staged_users == 0) {
      st.scales_set = it->set;
      st.ckv_scale = it->ckv_scale;
      st.kpe_scale = it->kpe_scale;
    }
  }
  if (txn.created_) {
    sequences_.Erase(seq);
  } else {
    sequences_.MarkIdle(seq, NowNs());  // an attempted append is a use too
  }
  txn.finished_ = true;
}

// ---- queries -------------------------------------------------------------------

SequenceSnapshot Pool::SnapshotOf(const Sequence& seq, bool count_shared, std::optional<size_t> pages_from) const {
  SequenceSnapshot s;
  s.id = seq.id();
  if (pages_from) {
    const size_t from = std::min(*pages_from, seq.pages().size());
    s.kv_indices.assign(seq.pages().begin() + static_cast<ptrdiff_t>(from), seq.pages().end());
    s.kv_indices_offset = static_cast<uint32_t>(from);
  } else {
    s.kv_indices = seq.pages();
    s.layer_lengths = seq.layer_lengths();
  }
  s.length = seq.length();
  s.page_size = static_cast<uint32_t>(options_.page_size);
  s.last_page_len = s.length == 0 ? 0 : (s.length - 1) % s.page_size + 1;
  s.capacity_tokens = static_cast<uint32_t>(seq.pages().size()) * s.page_size;
  s.generation = seq.generation();
  s.leases = static_cast<uint32_t>(seq.lease_tokens().size());
  s.pinned = seq.pinned();
  if (count_shared) {
    for (int32_t page : seq.pages()) s.shared_pages += allocator_->refs(page) > 1 ? 1 : 0;
  }
  return s;
}

absl::StatusOr<Sequence*> Pool::FindCommitted(const std::string& id) const {
  Sequence* seq = sequences_.Find(id);
  if (seq == nullptr || !seq->committed()) {
    const EndedSequences::Entry* ended = ended_.Find(id);
    return absl::NotFoundError(absl::StrCat(Who(id), " not found in pool ", Quote(name()),
                                            ended != nullptr ? absl::StrCat(": ", EndedSequences::Describe(*ended)) : ""));
  }
  return seq;
}

absl::Status Pool::CheckGeneration(const Sequence& seq, std::optional<uint64_t> expected) const {
  if (!expected || *expected == seq.generation()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      Who(seq.id()), " of pool ", Quote(name()), " has generation ", seq.generation(), ", not the ", *expected,
      " the call expects: the id now names another incarnation (it was freed and created again, or the generation is not this id's); nothing was changed"));
}

absl::StatusOr<Sequence*> Pool::Resolve(const SequenceRef& ref) const {
  if (ref.lease_id != 0) {
    const Lease* lease = leases_.Find(ref.lease_id);
    if (lease == nullptr || lease->sequence == nullptr) {
      return absl::NotFoundError(absl::StrCat("lease ", ref.lease_id, " of pool ", Quote(name()),
                                              lease == nullptr ? " is not held: it expired or was released"
                                                               : " is a page lease, not a sequence lease"));
    }
    if (!ref.id.empty() && ref.id != lease->sequence->id()) {
      return absl::InvalidArgumentError(absl::StrCat("lease ", ref.lease_id, " holds ", Who(lease->sequence->id()),
                                                     ", not ", Who(ref.id)));
    }
    MLAKV_RETURN_IF_ERROR(CheckGeneration(*lease->sequence, ref.expect_generation));
    return lease->sequence;
  }
  MLAKV_ASSIGN_OR_RETURN(Sequence * seq, FindCommitted(ref.id));
  MLAKV_RETURN_IF_ERROR(CheckGeneration(*seq, ref.expect_generation));
  return seq;
}

PoolSnapshot Pool::Snapshot() const {
  absl::ReaderMutexLock lock(&mu_);
  PoolSnapshot p;
  p.name = name();
  p.device = device_;
  p.num_layers = options_.num_layers;
  p.page_size = options_.page_size;
  p.pages_total = allocator_->total();
  p.pages_free = allocator_->free_count();
  p.pages_used = allocator_->used_count();
  p.sequences = static_cast<uint32_t>(sequences_.committed_count());
  p.max_sequences = options_.max_sequences;
  p.cache_bytes = backend_->cache_bytes();
  p.layers.reserve(layers_.size());
  for (const LayerState& st : layers_) p.layers.push_back(st);  // the LayerSnapshot part
  p.pages_shared = allocator_->shared_count();
  p.leases = static_cast<uint32_t>(leases_.size());
  p.sequences_retained = static_cast<uint32_t>(retained_.size());
  p.pages_indexed = static_cast<uint32_t>(prefix_.size());
  p.eviction_lru = options_.eviction.lru;
  p.counters = counters_;
  return p;
}

absl::StatusOr<SequenceSnapshot> Pool::GetSequence(const SequenceRef& ref, const std::optional<LeaseRequest>& lease) {
  int64_t duration_ms = 0;
  if (lease) {
    MLAKV_ASSIGN_OR_RETURN(duration_ms, CheckLeaseRequest(*lease));
  }
  absl::MutexLock lock(&mu_);  // exclusive: a query by id is a use (it moves in the use order)
  ReapExpiredLeases();
  MLAKV_ASSIGN_OR_RETURN(Sequence * seq, Resolve(ref.ById()));
  std::optional<LeaseSnapshot> taken;
  if (lease) {
    MLAKV_ASSIGN_OR_RETURN(taken, AddLease(seq, lease->holder, duration_ms, seq->length(), {}));
  }
  sequences_.Touch(seq, NowNs());
  SequenceSnapshot snapshot = SnapshotOf(*seq);
  snapshot.lease = std::move(taken);
  return snapshot;
}

SequenceListing Pool::ListSequences(size_t limit, const std::string& page_token) const {
  absl::ReaderMutexLock lock(&mu_);
  SequenceListing out;
  std::vector<const Sequence*> list = sequences_.ListAfter(page_token, limit + 1);
  const bool more = list.size() > limit;
  if (more) list.pop_back();
  for (const Sequence* seq : list) {
    out.sequences.push_back({seq->id(), seq->length(), static_cast<uint32_t>(seq->pages().size())});
  }
  if (more && !list.empty()) out.next_page_token = list.back()->id();
  out.total = static_cast<uint32_t>(sequences_.committed_count());
  return out;
}

absl::StatusOr<PageSnapshot> Pool::GetPage(int64_t page) const {
  absl::ReaderMutexLock lock(&mu_);
  if (page < 0 || page >= allocator_->total()) {
    return absl::OutOfRangeError(
        absl::StrCat("page ", page, " is outside [0, ", allocator_->total(), ") of pool ", Quote(name())));
  }
  PageSnapshot p;
  p.page = static_cast<int32_t>(page);
  p.used = allocator_->IsUsed(p.page);
  const SequenceTable::Owner owner = sequences_.OwnerOf(p.page);
  p.filled_per_layer.assign(options_.num_layers, 0);
  p.references = allocator_->refs(p.page);
  if (const std::string* hash = prefix_.HashOf(p.page)) p.block_hash = *hash;
  if (owner.sequence != nullptr) {
    p.sequence = owner.sequence->id();
    p.sequence_freed = owner.sequence->retained();
    p.page_index = owner.page_index;
    p.first_position = owner.page_index * static_cast<uint32_t>(options_.page_size);
    for (int32_t l = 0; l < options_.num_layers; ++l) {
      p.filled_per_layer[l] = owner.sequence->FilledInPage(l, owner.page_index, options_.page_size);
    }
  }
  return p;
}

absl::StatusOr<FreeResult> Pool::FreeSequence(const SequenceRef& ref) {
  absl::MutexLock lock(&mu_);
  ReapExpiredLeases();
  MLAKV_ASSIGN_OR_RETURN(Sequence * seq, Resolve(ref.ById()));
  if (seq->busy()) {
    return absl::AbortedError(absl::StrCat(Who(ref.id), " of pool ", Quote(name()),
                                           " has an append in progress; free it when the append has finished"));
  }
  if (!seq->lease_tokens().empty()) return RetainForLeases(seq);
  return FreeResult{.pages_freed = EraseSequence(seq)};
}

uint32_t Pool::EraseSequence(Sequence* seq, SequencesById::node_type* storage, const char* reason) {
  for (int32_t l = 0; l < options_.num_layers; ++l) layers_[l].tokens -= seq->layer_length(l);
  std::vector<int32_t> cut = sequences_.DetachTail(seq, 0);
  const uint32_t freed = ReleasePages(cut, reason, seq->id());
  SequencesById::node_type node = sequences_.Extract(seq);
  if (storage != nullptr) *storage = std::move(node);
  return freed;
}

int Pool::FreeIdle(absl::Time now, int max_batch) {
  if (options_.idle_ttl <= absl::ZeroDuration()) return 0;
  const int64_t cutoff = absl::ToUnixNanos(now - options_.idle_ttl);
  int freed = 0;
  uint64_t pages = 0;
  std::vector<SequencesById::node_type> storage;
  storage.reserve(max_batch);
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      // The use-order list holds exactly the idle committed sequences, least
      // recently used first: only the ones freed are visited.
      while (static_cast<int>(storage.size()) < max_batch) {
        Sequence* oldest = sequences_.LeastRecentlyUsed();
        if (oldest == nullptr || oldest->last_used_ns() >= cutoff) break;
        ended_.Record(oldest->id(), oldest->generation(), now, EndedSequences::Reason::kIdle);
        ++counters_.idle_freed;
        storage.emplace_back();
        pages += EraseSequence(oldest, &storage.back(), "ttl");
      }
    }
    const int batch = static_cast<int>(storage.size());
    freed += batch;
    storage.clear();  // the nodes are destroyed here, outside the lock
    if (batch < max_batch) break;
    std::this_thread::yield();  // let the appends waiting for the lock in first
  }
  if (freed > 0) {
    spdlog::info("pool {}: freed {} sequences ({} pages) idle for more than {}", Quote(name()), freed, pages,
                 absl::FormatDuration(options_.idle_ttl));
  }
  return freed;
}

absl::StatusOr<SequenceSnapshot> Pool::TruncateSequence(const SequenceRef& ref, uint32_t length) {
  const std::string& id = ref.id;
  absl::MutexLock lock(&mu_);
  ReapExpiredLeases();
  MLAKV_ASSIGN_OR_RETURN(Sequence * seq, Resolve(ref.ById()));
  if (seq->busy()) {
    return absl::AbortedError(absl::StrCat(Who(id), " of pool ", Quote(name()),
                                           " has an append in progress; truncate it when the append has finished"));
  }
  if (length > seq->max_length()) {
    return absl::OutOfRangeError(absl::StrCat("cannot truncate ", Who(id), " to ", length,
                                              " tokens: its longest layer holds ", seq->max_length()));
  }
  if (length < seq->protected_tokens()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot truncate ", Who(id), " to ", length, " tokens: ", seq->lease_tokens().size(),
        " lease(s) protect its first ", seq->protected_tokens(), " tokens (ListLeases shows them)"));
  }
  // Pages from the one that stops being complete on: their content will
  // change, so their hashes go (a page another holder shares is unchanged
  // and keeps its hash; the next write to it copies it first).
  const uint32_t complete = length / static_cast<uint32_t>(options_.page_size);
  // KV events first, while the hashes are known: every announced page from
  // the first incomplete one on is withdrawn (the partial one keeps its
  // page, the rest are released below), unless another holder shares it.
  WithdrawPages(seq, complete, seq->pages().size(), "truncate");
  for (size_t i = complete; i < seq->pages().size(); ++i) {
    if (allocator_->refs(seq->pages()[i]) == 1) prefix_.ErasePage(seq->pages()[i]);
  }
  seq->pending_hashes().erase(seq->pending_hashes().lower_bound(complete), seq->pending_hashes().end());
  {
    Sequence::LengthsEdit lengths = seq->EditLayerLengths();
    for (int32_t l = 0; l < options_.num_layers; ++l) {
      if (lengths[l] > length) {
        layers_[l].tokens -= lengths[l] - length;
        lengths[l] = length;
      }
    }
  }
  ReleasePages(sequences_.DetachTail(seq, static_cast<size_t>(CeilDiv(length, options_.page_size))), "truncate",
               seq->id());
  SequenceSnapshot snapshot = SnapshotOf(*seq);
  if (seq->empty()) {
    sequences_.Erase(seq);  // cut to nothing: not kept (docs/server.md "Model")
  } else {
    sequences_.Touch(seq, NowNs());
  }
  return snapshot;
}

// ---- reads ---------------------------------------------------------------------

absl::StatusOr<std::vector<int32_t>> Pool::PlanRead(const SequenceRef& ref, std::span<const uint32_t> layers,
                                                    uint32_t start, uint32_t* count) {
  const std::string& id = ref.id;
  absl::MutexLock lock(&mu_);
  ReapExpiredLeases();
  MLAKV_ASSIGN_OR_RETURN(Sequence * found, Resolve(ref));
  const Sequence& seq = *found;
  std::vector<int32_t> out;
  if (layers.empty()) {
    for (int32_t l = 0; l < options_.num_layers; ++l) out.push_back(l);
  }
  std::vector<bool> named(options_.num_layers, false);
  for (uint32_t l : layers) {
    if (l >= static_cast<uint32_t>(options_.num_layers)) {
      return absl::OutOfRangeError(
          absl::StrCat("layer ", l, " is outside [0, ", options_.num_layers, ") of pool ", Quote(name())));
    }
    if (named[l]) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", l, " is named twice in one ReadSequence; name each layer once"));
    }
    named[l] = true;
    out.push_back(static_cast<int32_t>(l));
  }
  uint32_t shortest = std::numeric_limits<uint32_t>::max();
  for (int32_t l : out) shortest = std::min(shortest, seq.layer_length(l));
  if (*count == 0) {
    if (start > shortest) {
      return absl::OutOfRangeError(absl::StrCat("start ", start, " is past the shortest requested layer of ", Who(id),
                                                ", which holds ", shortest, " tokens"));
    }
    *count = shortest - start;
  } else {
    const uint64_t end = static_cast<uint64_t>(start) + *count;
    for (int32_t l : out) {
      if (end > seq.layer_length(l)) {
        return absl::OutOfRangeError(absl::StrCat("tokens [", start, ", ", end, ") of ", Who(id),
                                                  " are not all written in layer ", l, ", which holds ",
                                                  seq.layer_length(l), " tokens"));
      }
    }
  }
  if (!found->retained()) sequences_.Touch(found, NowNs());
  return out;
}

absl::Status Pool::ReadRows(const SequenceRef& ref, int32_t layer, uint32_t start, uint32_t count,
                            const EntryRows& out, LayerSnapshot* layer_state) const {
  const std::string& id = ref.id;
  std::vector<int64_t> entries;
  {
    absl::ReaderMutexLock lock(&mu_);
    MLAKV_ASSIGN_OR_RETURN(Sequence * found, Resolve(ref));
    const Sequence& seq = *found;
    if (layer < 0 || layer >= options_.num_layers) return absl::OutOfRangeError(absl::StrCat("layer ", layer));
    if (static_cast<uint64_t>(start) + count > seq.layer_length(layer)) {
      return absl::AbortedError(absl::StrCat(Who(id), " layer ", layer, " was cut to ", seq.layer_length(layer),
                                             " tokens while being read"));
    }
    entries.reserve(count);
    for (uint32_t p = start; p < start + count; ++p) entries.push_back(EntryOf(seq, p));
    *layer_state = layers_[layer];  // the LayerSnapshot part
  }
  // Only this pool's worker writes the caches, and we are on it: the pages
  // cannot be rewritten during the copy even if they are freed meanwhile.
  return backend_->ReadEntries(layer, entries, out);
}

absl::Status Pool::CheckInvariants() const {
  absl::ReaderMutexLock lock(&mu_);
  if (allocator_->free_count() + allocator_->used_count() != allocator_->total()) {
    return absl::InternalError(absl::StrCat("free ", allocator_->free_count(), " + used ", allocator_->used_count(),
                                            " != total ", allocator_->total()));
  }
  // References: page tables (live and retained sequences), page leases,
  // in-flight copies.
  std::vector<int32_t> expected(allocator_->total(), 0);
  const std::vector<const Lease*> leases = leases_.ListAfter(0, std::numeric_limits<size_t>::max());
  size_t sequence_leases = 0;
  for (const Lease* lease : leases) {
    for (int32_t page : lease->pages) ++expected[page];
    if (lease->sequence != nullptr) {
      ++sequence_leases;
      if (lease->sequence->lease_tokens().count(lease->tokens) == 0) {
        return absl::InternalError(absl::StrCat("lease ", lease->id, " is not recorded on its sequence"));
      }
    }
  }
  for (const auto& [page, count] : cow_held_) expected[page] += count;
  for (const Sequence* seq : sequences_.ListAfter("", std::numeric_limits<size_t>::max())) {
    for (int32_t page : seq->lease_held_pages()) ++expected[page];
  }
  for (const auto& [seq, node] : retained_) {
    for (int32_t page : seq->lease_held_pages()) ++expected[page];
  }
  int32_t shared = 0;
  for (int32_t p = 0; p < allocator_->total(); ++p) {
    const SequenceTable::Holders& holders = sequences_.HoldersOf(p);
    expected[p] += static_cast<int32_t>(holders.size());
    if (allocator_->refs(p) != expected[p]) {
      return absl::InternalError(absl::StrCat("page ", p, " has ", allocator_->refs(p), " references but ",
                                              expected[p], " holders (page tables, page leases, copies)"));
    }
    if (expected[p] > 1) ++shared;
    for (const SequenceTable::Owner& owner : holders) {
      const auto& pages = owner.sequence->pages();
      if (owner.page_index >= pages.size() || pages[owner.page_index] != p) {
        return absl::InternalError(
            absl::StrCat("page ", p, " holder index disagrees with the page table of ", Who(owner.sequence->id())));
      }
    }
    if (prefix_.HashOf(p) != nullptr && !allocator_->IsUsed(p)) {
      return absl::InternalError(absl::StrCat("page ", p, " is free but indexed by block hash"));
    }
  }
  if (shared != allocator_->shared_count()) {
    return absl::InternalError(absl::StrCat("shared_count ", allocator_->shared_count(), " != ", shared));
  }
  std::vector<uint64_t> tokens(options_.num_layers, 0);
  if (!sequences_.IndexMatches()) return absl::InternalError("the sequences' hash index differs from the table");
  const std::vector<const Sequence*> all = sequences_.ListAfter("", std::numeric_limits<size_t>::max());
  if (all.size() != sequences_.committed_count()) {
    return absl::InternalError(
        absl::StrCat("committed_count ", sequences_.committed_count(), " != ", all.size(), " committed sequences"));
  }
  size_t reapable = 0, leases_on_sequences = 0;
  auto check_pages = [&](const Sequence* seq) -> absl::Status {
    for (size_t i = 0; i < seq->pages().size(); ++i) {
      bool found = false;
      for (const SequenceTable::Owner& o : sequences_.HoldersOf(seq->pages()[i])) found |= o.sequence == seq && o.page_index == i;
      if (!found) return absl::InternalError(absl::StrCat(Who(seq->id()), " page ", i, " is missing from its holders"));
    }
    for (int32_t l = 0; l < options_.num_layers; ++l) {
      if (seq->layer_length(l) > seq->pages().size() * static_cast<uint64_t>(options_.page_size)) {
        return absl::InternalError(absl::StrCat(Who(seq->id()), " layer ", l, " holds more tokens than its pages"));
      }
    }
    leases_on_sequences += seq->lease_tokens().size();
    return absl::OkStatus();
  };
  for (const Sequence* seq : all) {
    if (seq->empty()) return absl::InternalError(absl::StrCat(Who(seq->id()), " is committed but holds nothing"));
    if (seq->retained()) return absl::InternalError(absl::StrCat(Who(seq->id()), " is in the table but retained"));
    if (SequenceTable::Reapable(*seq)) ++reapable;
    for (int32_t l = 0; l < options_.num_layers; ++l) tokens[l] += seq->layer_length(l);
    const auto [lo, hi] = std::minmax_element(seq->layer_lengths().begin(), seq->layer_lengths().end());
    if (seq->length() != *lo || seq->max_length() != *hi) {
      return absl::InternalError(absl::StrCat(Who(seq->id()), " keeps length ", seq->length(), " and max_length ",
                                              seq->max_length(), " but its layers hold ", *lo, " to ", *hi));
    }
    MLAKV_RETURN_IF_ERROR(check_pages(seq));
  }
  for (const auto& [seq, node] : retained_) {
    if (!seq->retained() || seq->lease_tokens().empty() || node.mapped().get() != seq) {
      return absl::InternalError(absl::StrCat(Who(seq->id()), " is retained without a lease"));
    }
    MLAKV_RETURN_IF_ERROR(check_pages(seq));
  }
  if (leases_on_sequences != sequence_leases) {
    return absl::InternalError(absl::StrCat(sequence_leases, " sequence leases but ", leases_on_sequences,
                                            " recorded on sequences"));
  }
  for (int32_t l = 0; l < options_.num_layers; ++l) {
    if (tokens[l] != layers_[l].tokens) {
      return absl::InternalError(absl::StrCat("layer ", l, " token count ", layers_[l].tokens,
                                              " != sum over sequences ", tokens[l]));
    }
  }
  // Each append in flight holds its own busy sequence (a new one is not yet
  // committed), so no layer can have more staged users than that; with no
  // append in flight, none.
  size_t busy = sequences_.size() - sequences_.committed_count();
  for (const Sequence* seq : all) busy += seq->busy() ? 1 : 0;
  for (int32_t l = 0; l < options_.num_layers; ++l) {
    if (layers_[l].staged_users < 0 || static_cast<size_t>(layers_[l].staged_users) > busy) {
      return absl::InternalError(absl::StrCat("layer ", l, " has ", layers_[l].staged_users, " staged users but ", busy,
                                              " sequences have an append in flight"));
    }
  }
  size_t linked = 0;
  int64_t previous = std::numeric_limits<int64_t>::min();
  for (const Sequence* s = sequences_.LeastRecentlyUsed(); s != nullptr; s = SequenceTable::MoreRecent(s)) {
    if (!SequenceTable::Reapable(*s)) {
      return absl::InternalError(absl::StrCat(Who(s->id()), " is in the use-order list but not reapable"));
    }
    if (s->last_used_ns() < previous) {
      return absl::InternalError(absl::StrCat("use-order list out of order at ", Who(s->id())));
    }
    previous = s->last_used_ns();
    if (++linked > all.size()) return absl::InternalError("use-order list has a cycle");
  }
  if (linked != reapable) {
    return absl::InternalError(absl::StrCat("use-order list has ", linked, " sequences but ", reapable,
                                            " are reapable"));
  }
  return absl::OkStatus();
}

}  // namespace mlakv::server
