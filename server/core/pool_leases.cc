// Pool: leases (sequence leases and page leases) and the sequences freed
// while leased. See pool.h "Cache management" and docs/server.md "Leases".
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "server/core/ids.h"
#include "server/core/pool.h"

namespace mlakv::server {

absl::StatusOr<int64_t> Pool::CheckLeaseRequest(const LeaseRequest& request) const {
  if (request.holder.empty() || request.holder.size() > kMaxLeaseHolderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("lease holder ", Quote(request.holder), " is ",
                                                   request.holder.size(), " bytes; name who holds the lease in 1..",
                                                   kMaxLeaseHolderBytes, " bytes (e.g. the decode worker's name)"));
  }
  return LeaseDurationMs(request.duration);
}

absl::StatusOr<int64_t> Pool::LeaseDurationMs(absl::Duration asked) const {
  const absl::Duration d = asked == absl::ZeroDuration() ? options_.default_lease_duration : asked;
  if (d < absl::Milliseconds(1) || d > options_.max_lease_duration) {
    return absl::InvalidArgumentError(absl::StrCat("lease duration ", absl::FormatDuration(d),
                                                   " is outside [1ms, ", absl::FormatDuration(options_.max_lease_duration),
                                                   "] (the pool's max_lease_seconds); renew a lease to keep it longer"));
  }
  return absl::ToInt64Milliseconds(d);
}

LeaseSnapshot Pool::SnapshotOf(const Lease& lease) const {
  LeaseSnapshot s;
  s.id = lease.id;
  if (lease.sequence != nullptr) {
    s.sequence = lease.sequence->id();
    s.sequence_freed = lease.sequence->retained();
  }
  s.generation = lease.generation;
  s.holder = lease.holder;
  s.tokens = lease.tokens;
  s.pages = lease.pages;
  s.expire_unix_ms = lease.expire_ns / 1'000'000;
  s.duration_ms = lease.duration_ms;
  return s;
}

absl::StatusOr<LeaseSnapshot> Pool::AddLease(Sequence* seq, const std::string& holder, int64_t duration_ms,
                                             uint32_t tokens, std::vector<int32_t> pages) {
  if (leases_.size() >= options_.max_leases) {
    return absl::ResourceExhaustedError(absl::StrCat("pool ", Quote(name()), " holds ", leases_.size(),
                                                     " leases, its max_leases; release leases first"));
  }
  if (seq != nullptr && seq->lease_tokens().size() >= options_.max_leases_per_sequence) {
    return absl::ResourceExhaustedError(absl::StrCat(Quote(seq->id()), " of pool ", Quote(name()), " has ",
                                                     seq->lease_tokens().size(),
                                                     " leases, the pool's max_leases_per_sequence"));
  }
  if (seq != nullptr && tokens == 0) {
    // A lease on nothing would still pin the sequence against eviction and
    // the idle TTL, silently; a layer-wise writer's sequence gets here.
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", Quote(seq->id()), " holds no token in every layer yet (its longest layer holds ",
        seq->max_length(), "); a lease covers tokens written in every layer, so lease it once all layers are in"));
  }
  if (seq != nullptr && seq->busy() && (seq->rewrite_floor() < tokens || seq->cow_in_flight())) {
    // The append in flight has rewritten a position the lease would cover,
    // or copied a shared page whose copy it might still drop.
    return absl::AbortedError(absl::StrCat("sequence ", Quote(seq->id()), " has an append in progress that ",
                                           seq->cow_in_flight() ? "copies a shared page"
                                                                : absl::StrCat("rewrites position ", seq->rewrite_floor()),
                                           "; lease it when the append has finished"));
  }
  if (!pages.empty()) {
    if (absl::Status s = allocator_->Ref(pages); !s.ok()) return s;  // pages come from the index: a bug
  }
  Lease lease;
  lease.id = NextId();
  lease.holder = holder;
  lease.expire_ns = NowNs() + duration_ms * 1'000'000;
  lease.duration_ms = duration_ms;
  lease.sequence = seq;
  lease.generation = seq != nullptr ? seq->generation() : 0;
  lease.tokens = tokens;
  lease.pages = std::move(pages);
  if (seq != nullptr) sequences_.AddLease(seq, tokens);
  ++counters_.leases_acquired;
  return SnapshotOf(*leases_.Add(std::move(lease)));
}

absl::StatusOr<LeaseSnapshot> Pool::AcquireLease(const SequenceRef& ref, const LeaseRequest& lease, uint32_t tokens) {
  MLAKV_ASSIGN_OR_RETURN(const int64_t duration_ms, CheckLeaseRequest(lease));
  absl::MutexLock lock(&mu_);
  ReapExpiredLeases();
  MLAKV_ASSIGN_OR_RETURN(Sequence * seq, Resolve(ref.ById()));
  const uint32_t length = seq->length();
  if (tokens == 0) tokens = length;
  if (tokens > length) {
    return absl::OutOfRangeError(absl::StrCat("a lease on ", tokens, " tokens of sequence ", Quote(ref.id),
                                              ": it holds ", length, " in every layer"));
  }
  return AddLease(seq, lease.holder, duration_ms, tokens, {});
}

absl::StatusOr<LeaseSnapshot> Pool::RenewLease(uint64_t lease_id, absl::Duration duration) {
  absl::MutexLock lock(&mu_);
  ReapExpiredLeases();
  Lease* lease = leases_.Find(lease_id);
  if (lease == nullptr) {
    return absl::NotFoundError(absl::StrCat("lease ", lease_id, " of pool ", Quote(name()),
                                            " is not held: it expired or was released; acquire a new one"));
  }
  MLAKV_ASSIGN_OR_RETURN(const int64_t duration_ms, LeaseDurationMs(duration));
  leases_.SetExpiry(lease, NowNs() + duration_ms * 1'000'000);
  lease->duration_ms = duration_ms;
  return SnapshotOf(*lease);
}

absl::StatusOr<uint32_t> Pool::ReleaseLease(uint64_t lease_id) {
  absl::MutexLock lock(&mu_);
  ReapExpiredLeases();
  if (leases_.Find(lease_id) == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("lease ", lease_id, " of pool ", Quote(name()), " is not held: it expired or was released"));
  }
  ++counters_.leases_released;
  return EndLease(lease_id);
}

uint32_t Pool::EndLease(uint64_t lease_id) {
  Lease lease = leases_.Remove(lease_id);
  uint32_t freed = lease.pages.empty() ? 0 : ReleasePages(lease.pages, "lease_end");
  Sequence* seq = lease.sequence;
  if (seq == nullptr) return freed;
  sequences_.RemoveLease(seq, lease.tokens, NowNs());
  if (seq->lease_tokens().empty() && !seq->lease_held_pages().empty()) {
    freed += ReleasePages(seq->lease_held_pages(), "lease_end", seq->id());
    seq->lease_held_pages().clear();
  }
  if (seq->retained() && seq->lease_tokens().empty()) {
    freed += ReleasePages(sequences_.DetachTail(seq, 0), "lease_end", seq->id());
    retained_.erase(seq);  // destroys the sequence
  }
  return freed;
}

int Pool::ReapExpiredLeases() {
  const int64_t now = NowNs();
  int ended = 0;
  for (Lease* lease = leases_.Earliest(); lease != nullptr && lease->expire_ns <= now; lease = leases_.Earliest()) {
    EndLease(lease->id);
    ++counters_.leases_expired;
    ++ended;
  }
  return ended;
}

int Pool::ExpireLeases() {
  absl::MutexLock lock(&mu_);
  return ReapExpiredLeases();
}

LeaseListing Pool::ListLeases(size_t limit, uint64_t after) {
  absl::MutexLock lock(&mu_);
  ReapExpiredLeases();
  LeaseListing out;
  std::vector<const Lease*> list = leases_.ListAfter(after, limit + 1);
  const bool more = list.size() > limit;
  if (more) list.pop_back();
  for (const Lease* lease : list) out.leases.push_back(SnapshotOf(*lease));
  if (more && !list.empty()) out.next_after = list.back()->id;
  out.total = static_cast<uint32_t>(leases_.size());
  return out;
}

FreeResult Pool::RetainForLeases(Sequence* seq) {
  const uint32_t protect = seq->protected_tokens();
  const size_t keep = (static_cast<size_t>(protect) + options_.page_size - 1) / options_.page_size;
  {
    Sequence::LengthsEdit lengths = seq->EditLayerLengths();
    for (int32_t l = 0; l < options_.num_layers; ++l) {
      layers_[l].tokens -= lengths[l];
      lengths[l] = std::min(lengths[l], protect);
    }
  }
  FreeResult result;
  result.pages_freed = ReleasePages(sequences_.DetachTail(seq, keep), "free", seq->id());
  result.leases = static_cast<uint32_t>(seq->lease_tokens().size());
  result.pages_retained = static_cast<uint32_t>(seq->pages().size());
  seq->pending_hashes().clear();
  retained_.emplace(seq, sequences_.Retain(seq));
  return result;
}

}  // namespace mlakv::server
