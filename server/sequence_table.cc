#include "server/sequence_table.h"

namespace mlakv::server {

Sequence* SequenceTable::Find(std::string_view id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second.get();
}

Sequence* SequenceTable::Add(std::string id) {
  auto seq = std::make_unique<Sequence>(id, num_layers_);
  Sequence* raw = seq.get();
  by_id_.emplace(std::move(id), std::move(seq));
  return raw;
}

void SequenceTable::Erase(Sequence* sequence) {
  for (int32_t page : sequence->pages()) owners_[page] = Owner{};
  by_id_.erase(sequence->id());
}

void SequenceTable::AttachPages(Sequence* sequence, std::span<const int32_t> pages) {
  std::vector<int32_t>& table = sequence->mutable_pages();
  for (int32_t page : pages) {
    owners_[page] = Owner{sequence, static_cast<uint32_t>(table.size())};
    table.push_back(page);
  }
}

std::vector<int32_t> SequenceTable::DetachTail(Sequence* sequence, size_t keep) {
  std::vector<int32_t>& table = sequence->mutable_pages();
  if (keep >= table.size()) return {};
  std::vector<int32_t> cut(table.begin() + static_cast<std::ptrdiff_t>(keep), table.end());
  table.resize(keep);
  for (int32_t page : cut) owners_[page] = Owner{};
  return cut;
}

std::vector<const Sequence*> SequenceTable::ListAfter(std::string_view after, size_t limit) const {
  std::vector<const Sequence*> out;
  auto it = after.empty() ? by_id_.begin() : by_id_.upper_bound(after);
  for (; it != by_id_.end() && out.size() < limit; ++it) {
    if (it->second->committed()) out.push_back(it->second.get());
  }
  return out;
}

size_t SequenceTable::committed_count() const {
  size_t n = 0;
  for (const auto& [id, seq] : by_id_) n += seq->committed() ? 1 : 0;
  return n;
}

}  // namespace mlakv::server
