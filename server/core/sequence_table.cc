#include "server/core/sequence_table.h"

#include <algorithm>

namespace mlakv::server {

Sequence* SequenceTable::Find(std::string_view id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second.get();
}

Sequence* SequenceTable::Add(std::string id) {
  auto seq = std::make_unique<Sequence>(id, num_layers_);
  Sequence* raw = seq.get();
  raw->busy_ = true;
  raw->self_ = by_id_.emplace(std::move(id), std::move(seq)).first;
  return raw;
}

void SequenceTable::Erase(Sequence* sequence) { Extract(sequence); }

SequencesById::node_type SequenceTable::Extract(Sequence* sequence) {
  for (int32_t page : sequence->pages()) owners_[page] = Owner{};
  Unlink(sequence);
  if (sequence->committed_) --committed_count_;
  return by_id_.extract(sequence->self_);
}

void SequenceTable::MarkBusy(Sequence* sequence) {
  Unlink(sequence);
  sequence->busy_ = true;
}

void SequenceTable::MarkIdle(Sequence* sequence, int64_t now_ns) {
  sequence->busy_ = false;
  sequence->last_used_ns_ = NotBeforeTail(now_ns);
  if (sequence->committed_) Link(sequence);
}

void SequenceTable::SetCommitted(Sequence* sequence) {
  if (sequence->committed_) return;
  sequence->committed_ = true;
  ++committed_count_;
}

void SequenceTable::Touch(Sequence* sequence, int64_t now_ns) {
  sequence->last_used_ns_ = NotBeforeTail(now_ns);
  if (!sequence->in_lru_) return;
  Unlink(sequence);
  Link(sequence);
}

int64_t SequenceTable::NotBeforeTail(int64_t now_ns) const {
  // The wall clock may step back; the list must stay ordered by time.
  return lru_tail_ != nullptr ? std::max(now_ns, lru_tail_->last_used_ns_) : now_ns;
}

void SequenceTable::Link(Sequence* sequence) {
  if (sequence->in_lru_) return;
  sequence->lru_prev_ = lru_tail_;
  sequence->lru_next_ = nullptr;
  if (lru_tail_ != nullptr) {
    lru_tail_->lru_next_ = sequence;
  } else {
    lru_head_ = sequence;
  }
  lru_tail_ = sequence;
  sequence->in_lru_ = true;
}

void SequenceTable::Unlink(Sequence* sequence) {
  if (!sequence->in_lru_) return;
  if (sequence->lru_prev_ != nullptr) {
    sequence->lru_prev_->lru_next_ = sequence->lru_next_;
  } else {
    lru_head_ = sequence->lru_next_;
  }
  if (sequence->lru_next_ != nullptr) {
    sequence->lru_next_->lru_prev_ = sequence->lru_prev_;
  } else {
    lru_tail_ = sequence->lru_prev_;
  }
  sequence->lru_prev_ = sequence->lru_next_ = nullptr;
  sequence->in_lru_ = false;
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

}  // namespace mlakv::server
