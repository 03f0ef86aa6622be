#include "server/core/prefix_index.h"

namespace mlakv::server {

bool PrefixIndex::Insert(absl::string_view hash, int32_t page) {
  if (!hash_of_[page].empty()) return false;
  auto [it, inserted] = page_of_.try_emplace(std::string(hash), page);
  if (!inserted) return false;
  hash_of_[page] = it->first;
  return true;
}

void PrefixIndex::ErasePage(int32_t page) {
  if (hash_of_[page].empty()) return;
  page_of_.erase(hash_of_[page]);
  hash_of_[page].clear();
  hash_of_[page].shrink_to_fit();
}

}  // namespace mlakv::server
