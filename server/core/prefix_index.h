// PrefixIndex: the pages of one pool indexed by a block hash the client
// computed (vLLM-style prefix caching, docs/server.md "Shared prefixes").
//
// A hash is opaque bytes (1..kMaxBlockHashBytes), chained by the client: each
// covers its parent's hash and its page's tokens in every layer, so equal
// hashes mean equal prefixes up to and including that page. The server
// trusts that: two different pages under one hash are the client's error
// (the first page indexed keeps the hash). A page carries at most one hash.
// O(1) per operation. Not thread-safe: the owning Pool holds its mutex.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace mlakv::server {

inline constexpr size_t kMaxBlockHashBytes = 64;

class PrefixIndex {
 public:
  explicit PrefixIndex(int32_t num_pages) : hash_of_(num_pages) {}

  // Indexes `page` under `hash` unless the hash already names a page or the
  // page already has a hash; returns whether it did.
  bool Insert(absl::string_view hash, int32_t page);
  // The page indexed under `hash`, or -1.
  int32_t Find(absl::string_view hash) const {
    auto it = page_of_.find(hash);
    return it == page_of_.end() ? -1 : it->second;
  }
  // Forgets the page's hash (no-op when it has none).
  void ErasePage(int32_t page);
  // The page's hash, or null.
  const std::string* HashOf(int32_t page) const {
    return hash_of_[page].empty() ? nullptr : &hash_of_[page];
  }
  size_t size() const { return page_of_.size(); }

 private:
  absl::flat_hash_map<std::string, int32_t> page_of_;
  std::vector<std::string> hash_of_;  // [num_pages], empty: none
};

}  // namespace mlakv::server
