// EndedSequences: a bounded memory of sequences the server ended on its own
// (evicted, or freed by the idle TTL), so that a later call naming one is
// told what happened and when instead of a bare NOT_FOUND. Holds the most
// recent `capacity` ids; an id created again is forgotten. O(1) per call.
// Not thread-safe: the owning Pool holds its mutex.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"

namespace mlakv::server {

class EndedSequences {
 public:
  enum class Reason { kEvicted, kIdle };
  struct Entry {
    std::string id;
    uint64_t generation = 0;
    absl::Time when;
    Reason reason = Reason::kEvicted;
  };

  explicit EndedSequences(size_t capacity) : ring_(capacity) {}

  void Record(absl::string_view id, uint64_t generation, absl::Time when, Reason reason);
  void Forget(absl::string_view id);
  const Entry* Find(absl::string_view id) const;
  // "it was evicted at ... to make room (generation G)" for a NOT_FOUND.
  static std::string Describe(const Entry& e);

 private:
  std::vector<std::optional<Entry>> ring_;
  size_t next_ = 0;
  absl::flat_hash_map<std::string, size_t> slot_of_;
};

}  // namespace mlakv::server
