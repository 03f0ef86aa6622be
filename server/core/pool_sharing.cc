// Pool: shared pages — forks, the block-hash prefix index, page copies.
// See pool.h "Cache management" and docs/server.md "Shared pages".
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "kernels/nvfp4_format.h"
#include "server/core/ids.h"
#include "server/core/pool.h"

namespace mlakv::server {
namespace {

template <typename Hash>
absl::Status CheckHashes(std::span<const Hash> hashes) {
  if (hashes.size() > kMaxBlockHashesPerCall) {
    return absl::InvalidArgumentError(absl::StrCat(hashes.size(), " block hashes in one call; at most ",
                                                   kMaxBlockHashesPerCall, " are accepted"));
  }
  for (size_t i = 0; i < hashes.size(); ++i) {
    if (hashes[i].empty() || hashes[i].size() > kMaxBlockHashBytes) {
      return absl::InvalidArgumentError(absl::StrCat("block hash ", i, " is ", hashes[i].size(),
                                                     " bytes; each must be 1..", kMaxBlockHashBytes));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckNewId(const std::string& id) {
  if (id.empty()) return absl::InvalidArgumentError("target sequence id is empty; name the new sequence");
  if (id.size() > kMaxSequenceIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("target sequence id ", Quote(id), " is ", id.size(),
                                                   " bytes; at most ", kMaxSequenceIdBytes, " are accepted"));
  }
  return absl::OkStatus();
}

}  // namespace

void Pool::IndexCompletePages(Sequence* seq) {
  std::map<uint32_t, std::string>& pending = seq->pending_hashes();
  if (pending.empty()) return;
  const size_t complete =
      std::min<size_t>(seq->length() / static_cast<uint32_t>(options_.page_size), seq->pages().size());
  while (!pending.empty() && pending.begin()->first < complete) {
    prefix_.Insert(pending.begin()->second, seq->pages()[pending.begin()->first]);
    pending.erase(pending.begin());
  }
}

absl::Status Pool::CopyPage(int32_t from, int32_t to, uint32_t entries) {
  std::vector<int64_t> src(entries), dst(entries);
  for (uint32_t i = 0; i < entries; ++i) {
    src[i] = static_cast<int64_t>(from) * options_.page_size + i;
    dst[i] = static_cast<int64_t>(to) * options_.page_size + i;
  }
  std::vector<uint8_t> ckv(entries * format::kCkvPackedBytes), sf(entries * format::kCkvSfBytes),
      kpe(entries * format::kKpeBytes);
  const EntryRows rows{ckv.data(), sf.data(), kpe.data()};
  for (int32_t l = 0; l < options_.num_layers; ++l) {
    MLAKV_RETURN_IF_ERROR(backend_->ReadEntries(l, src, rows));
    MLAKV_RETURN_IF_ERROR(backend_->WriteEntries(l, dst, rows));
  }
  return absl::OkStatus();
}

absl::StatusOr<PrefixMatch> Pool::MatchPrefix(std::span<const std::string> block_hashes,
                                              const std::optional<LeaseRequest>& lease) {
  const std::vector<absl::string_view> views(block_hashes.begin(), block_hashes.end());
  return MatchPrefix(std::span<const absl::string_view>(views), lease);
}

absl::StatusOr<PrefixMatch> Pool::MatchPrefix(std::span<const absl::string_view> block_hashes,
                                              const std::optional<LeaseRequest>& lease) {
  MLAKV_RETURN_IF_ERROR(CheckHashes(block_hashes));
  int64_t duration_ms = 0;
  if (lease) {
    MLAKV_ASSIGN_OR_RETURN(duration_ms, CheckLeaseRequest(*lease));
  }
  absl::MutexLock lock(&mu_);
  if (lease) ReapExpiredLeases();
  PrefixMatch match;
  match.kv_indices.reserve(block_hashes.size());
  for (absl::string_view hash : block_hashes) {
    const int32_t page = prefix_.Find(hash);
    if (page < 0) break;
    match.kv_indices.push_back(page);
  }
  match.matched_pages = static_cast<uint32_t>(match.kv_indices.size());
  ++counters_.prefix_queries;
  counters_.prefix_hit_pages += match.matched_pages;
  if (lease && match.matched_pages > 0) {
    MLAKV_ASSIGN_OR_RETURN(match.lease, AddLease(nullptr, lease->holder, duration_ms,
                                                 match.matched_pages * options_.page_size, match.kv_indices));
  }
  return match;
}

absl::StatusOr<ForkResult> Pool::Fork(const ForkRequest& request) {
  MLAKV_RETURN_IF_ERROR(CheckNewId(request.target));
  const bool by_hash = request.source.id.empty();
  if (by_hash == request.block_hashes.empty()) {
    return absl::InvalidArgumentError(
        "name either a source sequence or a block-hash chain to fork from (exactly one of them)");
  }
  if (!by_hash && request.source.id == request.target) {
    return absl::InvalidArgumentError(absl::StrCat("cannot fork ", Quote(request.target), " onto itself"));
  }
  MLAKV_RETURN_IF_ERROR(CheckHashes(std::span<const std::string>(request.block_hashes)));
  const uint32_t ps = static_cast<uint32_t>(options_.page_size);
  Sequence* source = nullptr;
  Sequence* target = nullptr;
  uint32_t length = 0, partial = 0;
  int32_t copy_to = -1;
  std::vector<int32_t> shared;
  {
    absl::MutexLock lock(&mu_);
    ReapExpiredLeases();
    if (Sequence* existing = sequences_.Find(request.target); existing != nullptr) {
      return absl::AlreadyExistsError(absl::StrCat("sequence ", Quote(request.target), " already exists in pool ",
                                                   Quote(name()), "; fork into a new id or free it first"));
    }
    if (sequences_.size() >= options_.max_sequences) {
      return absl::ResourceExhaustedError(absl::StrCat("pool ", Quote(name()), " holds ", sequences_.size(),
                                                       " sequences, its max_sequences; ", Quote(request.target),
                                                       " cannot be created"));
    }
    if (by_hash) {
      for (const std::string& hash : request.block_hashes) {
        const int32_t page = prefix_.Find(hash);
        if (page < 0) break;
        shared.push_back(page);
      }
      ++counters_.prefix_queries;
      counters_.prefix_hit_pages += shared.size();
      if (shared.empty()) return ForkResult{};
      length = static_cast<uint32_t>(shared.size()) * ps;
    } else {
      MLAKV_ASSIGN_OR_RETURN(source, Resolve(request.source.ById()));
      if (source->busy()) {
        return absl::AbortedError(absl::StrCat("sequence ", Quote(request.source.id), " of pool ", Quote(name()),
                                               " has an append in progress; fork it when the append has finished"));
      }
      length = request.length == 0 ? source->length() : request.length;
      if (length > source->length()) {
        return absl::OutOfRangeError(absl::StrCat("cannot fork ", length, " tokens of sequence ",
                                                  Quote(request.source.id), ": it holds ", source->length(),
                                                  " in every layer"));
      }
      if (length == 0) {
        return absl::FailedPreconditionError(absl::StrCat("sequence ", Quote(request.source.id),
                                                          " holds no token in every layer; nothing to fork"));
      }
      shared.assign(source->pages().begin(), source->pages().begin() + length / ps);
      partial = length % ps;
      // The source is held like an append holds it: not evicted, freed or
      // written until the copy is done.
      sequences_.MarkBusy(source);
      if (partial > 0) {
        if (absl::Status room = MakeRoom(1, "this fork's partial last page"); !room.ok()) {
          sequences_.MarkIdle(source, NowNs());
          return room;
        }
        copy_to = (*allocator_->Allocate(1))[0];
      }
    }
    if (!shared.empty()) (void)allocator_->Ref(shared);  // used pages: they are held by the source or the index
    target = sequences_.Add(request.target, NextId());
    sequences_.AttachPages(target, shared);
    if (copy_to >= 0) sequences_.AttachPages(target, std::span<const int32_t>(&copy_to, 1));
  }
  // The partial page (on the worker: nothing else writes the caches, and the
  // source is held).
  absl::Status copied = absl::OkStatus();
  if (copy_to >= 0) copied = CopyPage(source->pages()[length / ps], copy_to, partial);
  if (copied.ok() && request.last_check) copied = request.last_check(target->pages().size());
  absl::MutexLock lock(&mu_);
  if (source != nullptr) sequences_.MarkIdle(source, NowNs());  // a fork is a use of the source
  if (!copied.ok()) {
    ReleasePages(sequences_.DetachTail(target, 0));
    sequences_.Erase(target);
    return copied;
  }
  {
    Sequence::LengthsEdit lengths = target->EditLayerLengths();
    for (int32_t l = 0; l < options_.num_layers; ++l) {
      lengths[l] = length;
      layers_[l].tokens += length;
    }
  }
  sequences_.SetCommitted(target);
  if (request.pin) sequences_.SetPinned(target);
  sequences_.MarkIdle(target, NowNs());
  ended_.Forget(request.target);
  ++counters_.forks;
  counters_.fork_pages_shared += shared.size();
  counters_.pages_copied += copy_to >= 0 ? 1 : 0;
  ForkResult result;
  result.sequence = SnapshotOf(*target);
  result.pages_shared = static_cast<uint32_t>(shared.size());
  result.pages_copied = copy_to >= 0 ? 1 : 0;
  return result;
}

}  // namespace mlakv::server
