#include "server/core/ended_sequences.h"

#include "absl/strings/str_cat.h"

namespace mlakv::server {

void EndedSequences::Record(absl::string_view id, uint64_t generation, absl::Time when, Reason reason) {
  if (ring_.empty()) return;
  Forget(id);
  std::optional<Entry>& slot = ring_[next_];
  if (slot) slot_of_.erase(slot->id);  // the oldest memory goes
  slot = Entry{std::string(id), generation, when, reason};
  slot_of_[slot->id] = next_;
  next_ = (next_ + 1) % ring_.size();
}

void EndedSequences::Forget(absl::string_view id) {
  auto it = slot_of_.find(id);
  if (it == slot_of_.end()) return;
  ring_[it->second].reset();
  slot_of_.erase(it);
}

const EndedSequences::Entry* EndedSequences::Find(absl::string_view id) const {
  auto it = slot_of_.find(id);
  return it == slot_of_.end() ? nullptr : &*ring_[it->second];
}

std::string EndedSequences::Describe(const Entry& e) {
  const std::string when = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", e.when, absl::UTCTimeZone());
  return e.reason == Reason::kEvicted
             ? absl::StrCat("it was evicted at ", when, " (generation ", e.generation,
                            ") to make room for other sequences; append its rows again")
             : absl::StrCat("it was freed at ", when, " (generation ", e.generation,
                            ") after being idle for longer than the pool's sequence_idle_ttl");
}

}  // namespace mlakv::server
