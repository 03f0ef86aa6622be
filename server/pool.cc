#include "server/pool.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "kernels/nvfp4_format.h"
#include "kernels/quantize_append.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {
namespace {

using format::kCkvDim;
using format::kCkvPackedBytes;
using format::kCkvSfBytes;
using format::kKpeBytes;
using format::kKpeDim;

constexpr size_t kMaxSequenceIdBytes = 1024;

const char* ShortDTypeName(DType d) { return d == DType::kFloat16 ? "fp16" : "bf16"; }

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t NowNs() { return absl::ToUnixNanos(absl::Now()); }

}  // namespace

// ---- Pool --------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Pool>> Pool::Create(const Options& options) {
  const std::string where = absl::StrCat("pool '", options.name, "': ");
  if (options.name.empty()) return absl::InvalidArgumentError("pool name is empty");
  if (options.num_layers < 1 || options.page_size < 1 || options.num_pages < 1) {
    return absl::InvalidArgumentError(absl::StrCat(where, "num_layers, page_size and num_pages must be >= 1, got ",
                                                   options.num_layers, ", ", options.page_size, ", ",
                                                   options.num_pages));
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
  absl::StatusOr<std::unique_ptr<PageAllocator>> allocator = PageAllocator::Create({.num_pages = options.num_pages});
  if (!allocator.ok()) return allocator.status();
  absl::StatusOr<std::unique_ptr<CacheBackend>> backend = CreateCacheBackend(
      options.device,
      {.num_layers = options.num_layers, .num_pages = options.num_pages, .page_size = options.page_size});
  if (!backend.ok()) {
    return absl::Status(backend.status().code(), absl::StrCat(where, backend.status().message()));
  }
  if (options.wrap_backend) *backend = options.wrap_backend(std::move(*backend));  // operations: metrics
  std::string device = (*backend)->device();
  return std::unique_ptr<Pool>(new Pool(options, std::move(device), std::move(*backend), std::move(*allocator)));
}

Pool::Pool(const Options& options, std::string device, std::unique_ptr<CacheBackend> backend,
           std::unique_ptr<PageAllocator> allocator)
    : options_(options),
      device_(std::move(device)),
      max_tokens_(static_cast<int64_t>(options.num_pages) * options.page_size),
      backend_(std::move(backend)),
      allocator_(std::move(allocator)),
      sequences_(options.num_layers, options.num_pages),
      layers_(options.num_layers),
      // The worker makes the pool's GPU current once, before its first task.
      worker_(std::make_unique<SerialExecutor>([device = device_] { BindThreadToDevice(device); })) {
  for (size_t l = 0; l < options.layer_scales.size(); ++l) {
    if (!options.layer_scales[l]) continue;
    LayerState& st = layers_[l];
    st.scales_set = true;
    st.scales_from_config = true;
    st.ckv_scale = options.layer_scales[l]->ckv_scale;
    st.kpe_scale = options.layer_scales[l]->kpe_scale;
  }
}

Pool::~Pool() { worker_.reset(); }

int64_t Pool::EntryOf(const Sequence& seq, uint32_t position) const {
  const int32_t page = seq.pages()[position / options_.page_size];
  return static_cast<int64_t>(page) * options_.page_size + position % options_.page_size;
}

void Pool::ReleasePages(std::span<const int32_t> pages) {
  if (absl::Status s = allocator_->Free(pages); !s.ok()) {
    spdlog::error("pool '{}': {}", name(), std::string(s.message()));  // a bug; the pages stay used rather than corrupt the list
  }
}

absl::StatusOr<std::unique_ptr<AppendTransaction>> Pool::BeginAppend(const std::string& id) {
  if (id.empty()) return absl::InvalidArgumentError("sequence id is empty; name the sequence (e.g. the request id)");
  if (id.size() > kMaxSequenceIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence id is ", id.size(), " bytes; at most ", kMaxSequenceIdBytes, " are accepted"));
  }
  absl::MutexLock lock(&mu_);
  Sequence* seq = sequences_.Find(id);
  bool created = false;
  if (seq == nullptr) {
    seq = sequences_.Add(std::string(id));
    created = true;
  } else if (seq->busy()) {
    return absl::AbortedError(absl::StrCat("sequence '", id, "' of pool '", name(),
                                           "' has another append in progress; retry when it has finished"));
  }
  seq->set_busy(true);
  std::unique_ptr<AppendTransaction> txn(new AppendTransaction(this, seq, std::string(id), options_.num_layers));
  txn->created_ = created;
  return txn;
}

absl::Status Pool::Stage(std::span<AppendTransaction* const> txns, std::span<const SequenceRowsIn* const> rows,
                         std::optional<DType> dtype) {
  if (txns.size() != rows.size()) return absl::InternalError("Pool::Stage: txns and rows differ in length");
  const int32_t ps = options_.page_size;

  // Per layer: the rows of every sequence, against the batch's page table.
  struct LayerPlan {
    std::vector<AppendSegment> segments;
  };
  std::map<int32_t, LayerPlan> plans;
  std::vector<int32_t> kv_indptr{0}, kv_indices;
  std::vector<LayerAppend> appends;
  std::vector<AppendTransaction::Undo*> undo_to_capture;

  {
    absl::MutexLock lock(&mu_);
    // ---- 1. validate everything; nothing changes in this step -------------
    std::map<int32_t, std::pair<float, float>> new_scales;  // layer -> scales this call sets
    std::map<int32_t, size_t> new_scales_owner;              // layer -> index of the txn that named them
    std::vector<int64_t> new_pages(txns.size(), 0);
    int64_t total_new_pages = 0;
    for (size_t i = 0; i < txns.size(); ++i) {
      AppendTransaction& txn = *txns[i];
      const SequenceRowsIn& r = *rows[i];
      if (txn.finished_) return absl::InternalError("Pool::Stage on a finished transaction");
      const std::string who = absl::StrCat("sequence '", txn.id_, "'");
      if (r.row_count > 0 && r.layers.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(who, ": row_count is ", r.row_count, " but no layers carry rows; add LayerRows entries"));
      }
      if (!r.layers.empty() && !dtype) {
        return absl::InvalidArgumentError(
            absl::StrCat(who, ": dtype is unset; set ROW_DTYPE_FLOAT16 or ROW_DTYPE_BFLOAT16"));
      }
      const uint64_t end = static_cast<uint64_t>(r.start) + r.row_count;
      const uint64_t needed_tokens = std::max<uint64_t>(r.row_count == 0 || r.layers.empty() ? 0 : end, r.reserve_tokens);
      if (needed_tokens > static_cast<uint64_t>(max_tokens_)) {
        return absl::ResourceExhaustedError(absl::StrCat(
            who, " would need ", needed_tokens, " tokens but pool '", name(), "' holds at most ", max_tokens_,
            " (", options_.num_pages, " pages of ", ps, "); nothing was written"));
      }
      absl::flat_hash_set<int64_t> seen;
      for (const LayerRowsIn& lr : r.layers) {
        if (lr.layer < 0 || lr.layer >= options_.num_layers) {
          return absl::OutOfRangeError(absl::StrCat(who, ": layer ", lr.layer, " is outside [0, ",
                                                    options_.num_layers, ") of pool '", name(), "'"));
        }
        if (!seen.insert(lr.layer).second) {
          return absl::InvalidArgumentError(absl::StrCat(who, ": layer ", lr.layer,
                                                         " appears twice in one message; send one entry per layer"));
        }
        const int esize = DTypeSize(*dtype);
        const uint64_t ckv_row = static_cast<uint64_t>(kCkvDim) * esize, kpe_row = static_cast<uint64_t>(kKpeDim) * esize;
        if (lr.ckv.size() != r.row_count * ckv_row) {
          return absl::InvalidArgumentError(absl::StrCat(who, " layer ", lr.layer, ": ckv bytes ", lr.ckv.size(),
                                                         " is not rows(", r.row_count, ") x ", ckv_row, " for ",
                                                         ShortDTypeName(*dtype)));
        }
        if (lr.kpe.size() != r.row_count * kpe_row) {
          return absl::InvalidArgumentError(absl::StrCat(who, " layer ", lr.layer, ": kpe bytes ", lr.kpe.size(),
                                                         " is not rows(", r.row_count, ") x ", kpe_row, " for ",
                                                         ShortDTypeName(*dtype)));
        }
        // Scales: named (both set) or not (both 0).
        const bool named = lr.ckv_scale != 0.0f || lr.kpe_scale != 0.0f;
        if (named) {
          for (auto [value, what] : {std::pair<float, const char*>{lr.ckv_scale, "ckv_scale"},
                                     {lr.kpe_scale, "kpe_scale"}}) {
            if (absl::StatusOr<float> s = CheckDecodeScale(value, what); !s.ok()) {
              return absl::InvalidArgumentError(absl::StrCat(
                  who, " layer ", lr.layer, ": ", s.status().message(),
                  value == 0.0f ? "; name both ckv_scale and kpe_scale, or neither to use the layer's" : ""));
            }
          }
        }
        const LayerState& st = layers_[lr.layer];
        auto decided = new_scales.find(static_cast<int32_t>(lr.layer));
        if (decided != new_scales.end()) {
          if (named && (!SameBits(lr.ckv_scale, decided->second.first) ||
                        !SameBits(lr.kpe_scale, decided->second.second))) {
            return absl::FailedPreconditionError(absl::StrCat(
                who, " layer ", lr.layer, ": names ckv_scale ", lr.ckv_scale, " kpe_scale ", lr.kpe_scale,
                " but another sequence of this call names ckv_scale ", decided->second.first, " kpe_scale ",
                decided->second.second, "; one layer has one pair of scales"));
          }
        } else if (st.scales_set) {
          if (named && (!SameBits(lr.ckv_scale, st.ckv_scale) || !SameBits(lr.kpe_scale, st.kpe_scale))) {
            const bool replaceable = !st.scales_from_config && st.tokens == 0 && st.staged_users == 0;
            if (!replaceable) {
              return absl::FailedPreconditionError(absl::StrCat(
                  who, " layer ", lr.layer, ": names ckv_scale ", lr.ckv_scale, " kpe_scale ", lr.kpe_scale,
                  " but layer ", lr.layer, " of pool '", name(), "' has ckv_scale ", st.ckv_scale, " kpe_scale ",
                  st.kpe_scale,
                  st.scales_from_config ? " fixed by configuration"
                                        : absl::StrCat(" and stores ", st.tokens,
                                                       " tokens (scales change only while a layer is empty)"),
                  "; append with the layer's scales or leave them unset"));
            }
            new_scales[static_cast<int32_t>(lr.layer)] = {lr.ckv_scale, lr.kpe_scale};
            new_scales_owner[static_cast<int32_t>(lr.layer)] = i;
          }
        } else if (named) {
          new_scales[static_cast<int32_t>(lr.layer)] = {lr.ckv_scale, lr.kpe_scale};
          new_scales_owner[static_cast<int32_t>(lr.layer)] = i;
        } else if (r.row_count > 0) {
          return absl::FailedPreconditionError(absl::StrCat(
              who, " layer ", lr.layer, ": layer ", lr.layer, " of pool '", name(),
              "' has no scales yet; name ckv_scale and kpe_scale in the first append to it (or configure them)"));
        }
        // No holes: start at or before what the layer holds (committed, or
        // staged by this same append).
        if (r.row_count > 0) {
          const uint32_t have = std::max(txn.committed_[lr.layer], txn.staged_end_[lr.layer]);
          if (r.start > have) {
            return absl::OutOfRangeError(absl::StrCat(who, " layer ", lr.layer, ": start ", r.start,
                                                      " would leave a hole; the layer holds ", have,
                                                      " tokens, so an append must start at or before ", have));
          }
        }
      }
      const int64_t pages_needed = CeilDiv(static_cast<int64_t>(needed_tokens), ps);
      new_pages[i] = std::max<int64_t>(0, pages_needed - static_cast<int64_t>(txn.sequence_->pages().size()));
      total_new_pages += new_pages[i];
    }
    if (total_new_pages > allocator_->free_count()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "pool '", name(), "' is full: this append needs ", total_new_pages, " more pages but ",
          allocator_->free_count(), " of ", allocator_->total(), " are free (page_size ", ps,
          "); nothing was written. Free or truncate sequences, or configure a larger pool"));
    }

    // ---- 2. allocate, set scales, plan the writes -------------------------
    absl::StatusOr<std::vector<int32_t>> pages = allocator_->Allocate(total_new_pages);
    if (!pages.ok()) return pages.status();
    size_t next = 0;
    for (size_t i = 0; i < txns.size(); ++i) {
      AppendTransaction& txn = *txns[i];
      sequences_.AttachPages(txn.sequence_, std::span<const int32_t>(pages->data() + next, new_pages[i]));
      next += new_pages[i];
      txn.pages_allocated_ += static_cast<uint32_t>(new_pages[i]);
    }
    for (const auto& [layer, scales] : new_scales) {
      LayerState& st = layers_[layer];
      txns[new_scales_owner[layer]]->scales_before_.push_back(
          {.layer = layer, .set = st.scales_set, .ckv_scale = st.ckv_scale, .kpe_scale = st.kpe_scale});
      st.scales_set = true;
      st.ckv_scale = scales.first;
      st.kpe_scale = scales.second;
    }
    for (size_t i = 0; i < txns.size(); ++i) {
      AppendTransaction& txn = *txns[i];
      const SequenceRowsIn& r = *rows[i];
      const Sequence& seq = *txn.sequence_;
      for (int32_t page : seq.pages()) kv_indices.push_back(page);
      kv_indptr.push_back(static_cast<int32_t>(kv_indices.size()));
      if (r.row_count == 0) continue;
      for (const LayerRowsIn& lr : r.layers) {
        const int32_t l = static_cast<int32_t>(lr.layer);
        if (!txn.touched_[l]) {
          txn.touched_[l] = true;
          ++layers_[l].staged_users;
        }
        plans[l].segments.push_back({.ckv = lr.ckv.data(),
                                     .kpe = lr.kpe.data(),
                                     .rows = static_cast<int32_t>(r.row_count),
                                     .request = static_cast<int32_t>(i),
                                     .start = static_cast<int32_t>(r.start),
                                     .device = lr.rows_device,
                                     .ckv_stride_bytes = lr.ckv_stride_bytes,
                                     .kpe_stride_bytes = lr.kpe_stride_bytes,
                                     .wait_events = {lr.wait_events[0], lr.wait_events[1]}});
        // Committed positions this message rewrites and whose old bytes are
        // not saved yet.
        const uint32_t rewrite_end = std::min<uint64_t>(static_cast<uint64_t>(r.start) + r.row_count, txn.committed_[l]);
        if (r.start < rewrite_end) {
          std::vector<bool>& saved = txn.saved_[l];
          if (saved.empty()) saved.assign(txn.committed_[l], false);
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
    // Pointers into undo_ stay valid: nothing else appends to it before the
    // capture below, and the vector is not touched by other threads.
    for (AppendTransaction* txn : txns) {
      for (AppendTransaction::Undo& u : txn->undo_) {
        if (!u.captured) undo_to_capture.push_back(&u);
      }
    }
    for (auto& [layer, plan] : plans) {
      const LayerState& st = layers_[layer];
      appends.push_back({.layer = layer,
                         .dtype = dtype.value_or(DType::kBFloat16),
                         .ckv_scale = st.ckv_scale,
                         .kpe_scale = st.kpe_scale,
                         .segments = plan.segments,
                         .kv_indptr = {},
                         .kv_indices = {}});
    }
  }
  for (LayerAppend& a : appends) {
    a.kv_indptr = kv_indptr;
    a.kv_indices = kv_indices;
  }

  // ---- 3. save what will be rewritten, then write (outside mu_) -----------
  for (AppendTransaction::Undo* u : undo_to_capture) {
    const size_t n = u->entries.size();
    u->ckv_packed.resize(n * kCkvPackedBytes);
    u->ckv_sf.resize(n * kCkvSfBytes);
    u->kpe.resize(n * kKpeBytes);
    if (absl::Status s = backend_->ReadEntries(u->layer, u->entries, {u->ckv_packed.data(), u->ckv_sf.data(), u->kpe.data()});
        !s.ok()) {
      return s;
    }
    u->captured = true;
  }
  if (absl::Status s = backend_->Append(appends); !s.ok()) return s;

  // ---- 4. record what the transactions hold now ---------------------------
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < txns.size(); ++i) {
    AppendTransaction& txn = *txns[i];
    const SequenceRowsIn& r = *rows[i];
    if (r.row_count == 0) continue;
    for (const LayerRowsIn& lr : r.layers) {
      txn.staged_end_[lr.layer] = std::max(txn.staged_end_[lr.layer], r.start + r.row_count);
      txn.rows_written_ += r.row_count;
    }
  }
  return absl::OkStatus();
}

SequenceSnapshot Pool::Commit(AppendTransaction& txn) {
  absl::MutexLock lock(&mu_);
  Sequence& seq = *txn.sequence_;
  for (int32_t l = 0; l < options_.num_layers; ++l) {
    if (!txn.touched_[l]) continue;
    const uint32_t before = seq.layer_length(l);
    const uint32_t after = std::max(before, txn.staged_end_[l]);
    layers_[l].tokens += after - before;
    seq.set_layer_length(l, after);
    --layers_[l].staged_users;
  }
  seq.set_busy(false);
  seq.set_committed(true);
  seq.Touch(NowNs());
  txn.undo_.clear();
  txn.finished_ = true;
  return SnapshotOf(seq);
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
      spdlog::error("pool '{}': restoring {} rewritten rows of sequence '{}' layer {} failed: {}", name(),
                    u.entries.size(), txn.id_, u.layer, std::string(s.message()));
    }
  }
  txn.undo_.clear();
  absl::MutexLock lock(&mu_);
  Sequence* seq = txn.sequence_;
  for (int32_t l = 0; l < options_.num_layers; ++l) {
    if (txn.touched_[l]) --layers_[l].staged_users;
  }
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
    seq->set_busy(false);
  }
  txn.finished_ = true;
}

// ---- queries -------------------------------------------------------------------

SequenceSnapshot Pool::SnapshotOf(const Sequence& seq) const {
  SequenceSnapshot s;
  s.id = seq.id();
  s.kv_indices = seq.pages();
  s.layer_lengths = seq.layer_lengths();
  s.length = seq.length();
  s.page_size = static_cast<uint32_t>(options_.page_size);
  s.last_page_len = s.length == 0 ? 0 : (s.length - 1) % s.page_size + 1;
  s.capacity_tokens = static_cast<uint32_t>(seq.pages().size()) * s.page_size;
  return s;
}

absl::StatusOr<Sequence*> Pool::FindCommitted(const std::string& id) const {
  Sequence* seq = sequences_.Find(id);
  if (seq == nullptr || !seq->committed()) {
    return absl::NotFoundError(absl::StrCat("sequence '", id, "' not found in pool '", name(), "'"));
  }
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
  p.cache_bytes = backend_->cache_bytes();
  for (const LayerState& st : layers_) {
    p.layers.push_back({.scales_set = st.scales_set,
                        .scales_from_config = st.scales_from_config,
                        .ckv_scale = st.ckv_scale,
                        .kpe_scale = st.kpe_scale,
                        .tokens = st.tokens});
  }
  return p;
}

absl::StatusOr<SequenceSnapshot> Pool::GetSequence(const std::string& id) const {
  absl::ReaderMutexLock lock(&mu_);
  absl::StatusOr<Sequence*> seq = FindCommitted(id);
  if (!seq.ok()) return seq.status();
  (*seq)->Touch(NowNs());
  return SnapshotOf(**seq);
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
        absl::StrCat("page ", page, " is outside [0, ", allocator_->total(), ") of pool '", name(), "'"));
  }
  PageSnapshot p;
  p.page = static_cast<int32_t>(page);
  p.used = allocator_->IsUsed(p.page);
  const SequenceTable::Owner& owner = sequences_.OwnerOf(p.page);
  p.filled_per_layer.assign(options_.num_layers, 0);
  if (owner.sequence != nullptr) {
    p.sequence = owner.sequence->id();
    p.page_index = owner.page_index;
    p.first_position = owner.page_index * static_cast<uint32_t>(options_.page_size);
    for (int32_t l = 0; l < options_.num_layers; ++l) {
      p.filled_per_layer[l] = owner.sequence->FilledInPage(l, owner.page_index, options_.page_size);
    }
  }
  return p;
}

absl::StatusOr<uint32_t> Pool::FreeSequence(const std::string& id) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Sequence*> found = FindCommitted(id);
  if (!found.ok()) return found.status();
  Sequence* seq = *found;
  if (seq->busy()) {
    return absl::AbortedError(absl::StrCat("sequence '", id, "' of pool '", name(),
                                           "' has an append in progress; free it when the append has finished"));
  }
  return EraseSequence(seq);
}

uint32_t Pool::EraseSequence(Sequence* seq) {
  for (int32_t l = 0; l < options_.num_layers; ++l) layers_[l].tokens -= seq->layer_length(l);
  std::vector<int32_t> cut = sequences_.DetachTail(seq, 0);
  ReleasePages(cut);
  sequences_.Erase(seq);
  return static_cast<uint32_t>(cut.size());
}

int Pool::FreeIdle(absl::Time now) {
  if (options_.idle_ttl <= absl::ZeroDuration()) return 0;
  const int64_t cutoff = absl::ToUnixNanos(now - options_.idle_ttl);
  absl::MutexLock lock(&mu_);
  std::vector<Sequence*> idle;
  for (const Sequence* seq : sequences_.ListAfter("", std::numeric_limits<size_t>::max())) {
    if (!seq->busy() && seq->last_used_ns() < cutoff) idle.push_back(const_cast<Sequence*>(seq));
  }
  for (Sequence* seq : idle) {
    const std::string id = seq->id();
    const uint32_t pages = EraseSequence(seq);
    spdlog::info("pool '{}': freed sequence '{}' ({} pages), idle for more than {}", name(), id, pages,
                 absl::FormatDuration(options_.idle_ttl));
  }
  return static_cast<int>(idle.size());
}

absl::StatusOr<SequenceSnapshot> Pool::TruncateSequence(const std::string& id, uint32_t length) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Sequence*> found = FindCommitted(id);
  if (!found.ok()) return found.status();
  Sequence* seq = *found;
  if (seq->busy()) {
    return absl::AbortedError(absl::StrCat("sequence '", id, "' of pool '", name(),
                                           "' has an append in progress; truncate it when the append has finished"));
  }
  if (length > seq->max_length()) {
    return absl::OutOfRangeError(absl::StrCat("cannot truncate sequence '", id, "' to ", length,
                                              " tokens: its longest layer holds ", seq->max_length()));
  }
  for (int32_t l = 0; l < options_.num_layers; ++l) {
    const uint32_t before = seq->layer_length(l);
    if (before > length) {
      layers_[l].tokens -= before - length;
      seq->set_layer_length(l, length);
    }
  }
  ReleasePages(sequences_.DetachTail(seq, static_cast<size_t>(CeilDiv(length, options_.page_size))));
  seq->Touch(NowNs());
  return SnapshotOf(*seq);
}

// ---- reads ---------------------------------------------------------------------

absl::StatusOr<std::vector<int32_t>> Pool::PlanRead(const std::string& id, std::span<const uint32_t> layers,
                                                    uint32_t start, uint32_t* count) const {
  absl::ReaderMutexLock lock(&mu_);
  absl::StatusOr<Sequence*> found = FindCommitted(id);
  if (!found.ok()) return found.status();
  const Sequence& seq = **found;
  seq.Touch(NowNs());
  std::vector<int32_t> out;
  if (layers.empty()) {
    for (int32_t l = 0; l < options_.num_layers; ++l) out.push_back(l);
  }
  for (uint32_t l : layers) {
    if (l >= static_cast<uint32_t>(options_.num_layers)) {
      return absl::OutOfRangeError(
          absl::StrCat("layer ", l, " is outside [0, ", options_.num_layers, ") of pool '", name(), "'"));
    }
    out.push_back(static_cast<int32_t>(l));
  }
  uint32_t shortest = std::numeric_limits<uint32_t>::max();
  for (int32_t l : out) shortest = std::min(shortest, seq.layer_length(l));
  if (*count == 0) {
    if (start > shortest) {
      return absl::OutOfRangeError(absl::StrCat("start ", start, " is past the shortest requested layer of sequence '",
                                                id, "', which holds ", shortest, " tokens"));
    }
    *count = shortest - start;
  } else {
    const uint64_t end = static_cast<uint64_t>(start) + *count;
    for (int32_t l : out) {
      if (end > seq.layer_length(l)) {
        return absl::OutOfRangeError(absl::StrCat("tokens [", start, ", ", end, ") of sequence '", id,
                                                  "' are not all written in layer ", l, ", which holds ",
                                                  seq.layer_length(l), " tokens"));
      }
    }
  }
  return out;
}

absl::Status Pool::ReadRows(const std::string& id, int32_t layer, uint32_t start, uint32_t count, const EntryRows& out,
                            LayerSnapshot* layer_state) const {
  std::vector<int64_t> entries;
  {
    absl::ReaderMutexLock lock(&mu_);
    absl::StatusOr<Sequence*> found = FindCommitted(id);
    if (!found.ok()) return found.status();
    const Sequence& seq = **found;
    if (layer < 0 || layer >= options_.num_layers) return absl::OutOfRangeError(absl::StrCat("layer ", layer));
    if (static_cast<uint64_t>(start) + count > seq.layer_length(layer)) {
      return absl::AbortedError(absl::StrCat("sequence '", id, "' layer ", layer, " was cut to ",
                                             seq.layer_length(layer), " tokens while being read"));
    }
    entries.reserve(count);
    for (uint32_t p = start; p < start + count; ++p) entries.push_back(EntryOf(seq, p));
    const LayerState& st = layers_[layer];
    *layer_state = {.scales_set = st.scales_set,
                    .scales_from_config = st.scales_from_config,
                    .ckv_scale = st.ckv_scale,
                    .kpe_scale = st.kpe_scale,
                    .tokens = st.tokens};
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
  int64_t owned = 0;
  for (int32_t p = 0; p < allocator_->total(); ++p) {
    const SequenceTable::Owner& owner = sequences_.OwnerOf(p);
    if (allocator_->IsUsed(p) != (owner.sequence != nullptr)) {
      return absl::InternalError(absl::StrCat("page ", p, (allocator_->IsUsed(p) ? " is used but has no owner"
                                                                                   : " is free but has an owner")));
    }
    if (owner.sequence != nullptr) {
      ++owned;
      const auto& pages = owner.sequence->pages();
      if (owner.page_index >= pages.size() || pages[owner.page_index] != p) {
        return absl::InternalError(absl::StrCat("page ", p, " owner index disagrees with the page table of '",
                                                owner.sequence->id(), "'"));
      }
    }
  }
  if (owned != allocator_->used_count()) return absl::InternalError("owned pages != used pages");
  std::vector<uint64_t> tokens(options_.num_layers, 0);
  for (const Sequence* seq : sequences_.ListAfter("", std::numeric_limits<size_t>::max())) {
    for (int32_t l = 0; l < options_.num_layers; ++l) {
      tokens[l] += seq->layer_length(l);
      if (seq->layer_length(l) > seq->pages().size() * static_cast<uint64_t>(options_.page_size)) {
        return absl::InternalError(absl::StrCat("sequence '", seq->id(), "' layer ", l, " holds more tokens than its pages"));
      }
    }
  }
  for (int32_t l = 0; l < options_.num_layers; ++l) {
    if (tokens[l] != layers_[l].tokens) {
      return absl::InternalError(absl::StrCat("layer ", l, " token count ", layers_[l].tokens,
                                              " != sum over sequences ", tokens[l]));
    }
  }
  return absl::OkStatus();
}

}  // namespace mlakv::server
