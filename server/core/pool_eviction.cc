// Pool: eviction under pressure (docs/server.md "Eviction") and the periodic
// upkeep. Candidates come from the SequenceTable's use-order list, which
// holds exactly the sequences that may go (committed, idle, no lease, not
// pinned), least recently used first: choosing one is O(1), and a call reads
// only the sequences it evicts.
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "server/core/pool.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {

void Pool::Evict(Sequence* seq, SequencesById::node_type* storage) {
  ended_.Record(seq->id(), seq->generation(), absl::FromUnixNanos(NowNs()), EndedSequences::Reason::kEvicted);
  ++counters_.evictions;
  counters_.evicted_pages += EraseSequence(seq, storage, "evict");
}

absl::Status Pool::MakeRoom(int64_t needed, const std::string& what) {
  const int64_t free = allocator_->free_count();
  if (needed <= free) return absl::OkStatus();
  const std::string full = absl::StrCat("pool ", Quote(name()), " is full: ", what, " needs ", needed,
                                        " more pages but ", free, " of ", allocator_->total(),
                                        " are free (page_size ", options_.page_size, ")");
  if (!options_.eviction.lru) {
    return absl::ResourceExhaustedError(absl::StrCat(
        full, "; nothing was written. Free or truncate sequences, configure a larger pool, or turn on eviction"));
  }
  // What evicting from the least recently used end would free, counting only
  // pages no one else holds; stop as soon as it is enough, so that nothing
  // is evicted for an append that would still not fit.
  const int64_t shortfall = needed - free;
  int64_t gain = 0;
  size_t victims = 0;
  for (const Sequence* s = sequences_.LeastRecentlyUsed(); s != nullptr && gain < shortfall;
       s = SequenceTable::MoreRecent(s)) {
    for (int32_t page : s->pages()) gain += allocator_->refs(page) == 1 ? 1 : 0;
    ++victims;
  }
  if (gain < shortfall) {
    return absl::ResourceExhaustedError(absl::StrCat(
        full, ", and evicting every sequence without a lease, an append in flight or a pin would free only ", gain,
        "; nothing was written or evicted"));
  }
  std::vector<SequencesById::node_type> storage(victims);
  for (size_t i = 0; i < victims; ++i) Evict(sequences_.LeastRecentlyUsed(), &storage[i]);
  if (needed > allocator_->free_count()) {
    return absl::ResourceExhaustedError(absl::StrCat(full, " after evicting ", victims, " sequences"));
  }
  return absl::OkStatus();
}

int Pool::EvictDownTo(int32_t target_used, int max_batch) {
  if (!options_.eviction.lru) return 0;
  int evicted = 0;
  std::vector<SequencesById::node_type> storage;
  storage.reserve(max_batch);
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      while (static_cast<int>(storage.size()) < max_batch && allocator_->used_count() > target_used) {
        Sequence* oldest = sequences_.LeastRecentlyUsed();
        if (oldest == nullptr) break;
        storage.emplace_back();
        Evict(oldest, &storage.back());
      }
    }
    const int batch = static_cast<int>(storage.size());
    evicted += batch;
    storage.clear();  // destroyed outside the lock
    if (batch < max_batch) break;
    std::this_thread::yield();
  }
  if (evicted > 0) {
    spdlog::info("pool {}: evicted {} sequences above the high watermark", Quote(name()), evicted);
  }
  return evicted;
}

void Pool::Maintain() {
  const absl::Time now = options_.clock ? options_.clock() : absl::Now();
  ExpireLeases();
  FreeIdle(now);
  const Options::Eviction& ev = options_.eviction;
  if (!ev.lru || ev.high_watermark <= 0.0) return;
  int32_t used = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    used = allocator_->used_count();
  }
  if (used >= ev.high_watermark * options_.num_pages) {
    EvictDownTo(static_cast<int32_t>(ev.low_watermark * options_.num_pages));
  }
}

}  // namespace mlakv::server
