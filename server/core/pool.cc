// Pool: creation, page release, queries, reads and the invariants; the
// appends are in pool_append.cc, the cache management in pool_events.cc,
// pool_eviction.cc, pool_leases.cc and pool_sharing.cc.
#include "server/core/pool.h"

#include <algorithm>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "server/backend/backend_factory.h"
#include "server/core/pool_internal.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {

using pool_internal::CeilDiv;
using pool_internal::Who;

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
                                                    uint32_t start, uint32_t* count, uint64_t* generation) {
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
  if (generation != nullptr) *generation = found->generation();
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
