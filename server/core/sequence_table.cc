#include "server/core/sequence_table.h"

#include <algorithm>

namespace mlakv::server {

Sequence* SequenceTable::Find(std::string_view id) const {
  auto it = index_.find(id);
  return it == index_.end() ? nullptr : *it;
}

Sequence* SequenceTable::Add(std::string id, uint64_t generation) {
  auto seq = std::make_unique<Sequence>(id, num_layers_, generation);
  Sequence* raw = seq.get();
  raw->busy_ = true;
  raw->self_ = by_id_.emplace(std::move(id), std::move(seq)).first;
  index_.insert(raw);
  return raw;
}

bool SequenceTable::IndexMatches() const {
  if (index_.size() != by_id_.size()) return false;
  for (const auto& [id, seq] : by_id_) {
    auto it = index_.find(std::string_view(id));
    if (it == index_.end() || *it != seq.get()) return false;
  }
  return true;
}

void SequenceTable::Erase(Sequence* sequence) { Extract(sequence); }

SequencesById::node_type SequenceTable::Extract(Sequence* sequence) {
  DetachTail(sequence, 0);  // nothing left normally: the caller released the pages
  return Retain(sequence);
}

SequencesById::node_type SequenceTable::Retain(Sequence* sequence) {
  Unlink(sequence);
  if (sequence->committed_) --committed_count_;
  sequence->retained_ = true;
  index_.erase(sequence);
  return by_id_.extract(sequence->self_);
}

void SequenceTable::MarkBusy(Sequence* sequence) {
  sequence->busy_ = true;
  Relink(sequence);
}

void SequenceTable::MarkIdle(Sequence* sequence, int64_t now_ns) {
  sequence->busy_ = false;
  sequence->last_used_ns_ = NotBeforeTail(now_ns);
  Unlink(sequence);  // to the most recent end
  Relink(sequence);
}

void SequenceTable::SetCommitted(Sequence* sequence) {
  if (sequence->committed_) return;
  sequence->committed_ = true;
  ++committed_count_;
  Relink(sequence);
}

void SequenceTable::SetPinned(Sequence* sequence) {
  sequence->pinned_ = true;
  Relink(sequence);
}

void SequenceTable::AddLease(Sequence* sequence, uint32_t tokens) {
  sequence->lease_tokens_.insert(tokens);
  Relink(sequence);
}

void SequenceTable::RemoveLease(Sequence* sequence, uint32_t tokens, int64_t now_ns) {
  auto it = sequence->lease_tokens_.find(tokens);
  if (it != sequence->lease_tokens_.end()) sequence->lease_tokens_.erase(it);
  if (!sequence->retained_) Touch(sequence, now_ns);
  Relink(sequence);
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

void SequenceTable::Relink(Sequence* sequence) {
  if (Reapable(*sequence)) {
    if (!sequence->in_lru_) {
      // Joins at the most recent end; its time must not precede the tail's.
      sequence->last_used_ns_ = NotBeforeTail(sequence->last_used_ns_);
      Link(sequence);
    }
  } else {
    Unlink(sequence);
  }
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

void SequenceTable::AddHolder(Sequence* sequence, size_t index) {
  Holders& h = holders_[sequence->pages_[index]];
  sequence->owner_slot_[index] = static_cast<uint32_t>(h.size());
  // The fields stored one by one: an Owner built whole on the stack and
  // copied in was a 4-byte store read back as 16 bytes, a store-forwarding
  // stall on every page (~80% of a 4,096-page AttachPages).
  Owner& owner = h.emplace_back();
  owner.sequence = sequence;
  owner.page_index = static_cast<uint32_t>(index);
}

void SequenceTable::RemoveHolder(Sequence* sequence, size_t index) {
  Holders& h = holders_[sequence->pages_[index]];
  const uint32_t slot = sequence->owner_slot_[index];
  if (slot + 1 != h.size()) {
    h[slot] = h.back();
    h[slot].sequence->owner_slot_[h[slot].page_index] = slot;
  }
  h.pop_back();
}

void SequenceTable::AttachPages(Sequence* sequence, std::span<const int32_t> pages) {
  const size_t want = sequence->pages_.size() + pages.size();
  if (want > sequence->pages_.capacity()) {  // at least doubling: a decode's one page a call stays amortized
    const size_t cap = std::max(want, 2 * sequence->pages_.capacity());
    sequence->pages_.reserve(cap);
    sequence->owner_slot_.reserve(cap);
  }
  for (int32_t page : pages) {
    sequence->pages_.push_back(page);
    sequence->owner_slot_.push_back(0);
    AddHolder(sequence, sequence->pages_.size() - 1);
  }
}

std::vector<int32_t> SequenceTable::DetachTail(Sequence* sequence, size_t keep) {
  std::vector<int32_t>& table = sequence->pages_;
  if (keep >= table.size()) return {};
  for (size_t i = keep; i < table.size(); ++i) RemoveHolder(sequence, i);
  std::vector<int32_t> cut(table.begin() + static_cast<std::ptrdiff_t>(keep), table.end());
  table.resize(keep);
  sequence->owner_slot_.resize(keep);
  return cut;
}

int32_t SequenceTable::ReplacePage(Sequence* sequence, size_t index, int32_t page) {
  RemoveHolder(sequence, index);
  const int32_t old = sequence->pages_[index];
  sequence->pages_[index] = page;
  AddHolder(sequence, index);
  return old;
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
