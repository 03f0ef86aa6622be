// Pool: the KV events it records (server/core/kv_events.h, docs/events.md).
//
// page_stored_ is kept whether or not an event log is attached: a page whose
// stored bytes no holder claims any more leaves the prefix index through it
// (ReleasePages).
//
// A page is announced stored once per time its bytes are complete in every
// layer (page_stored_), whichever sequence completed it: pages a fork shares
// are already announced by their first holder. It is announced removed when
// those bytes go: the page is freed (its last reference released), or a
// holder rewrites or truncates into it while no one else holds it (a write
// to a shared page copies it first, so the shared bytes stay announced).
#include "server/core/pool.h"

namespace mlakv::server {

void Pool::RecordEvent(KvEvent event) {
  if (options_.events == nullptr) return;  // page_stored_ is kept all the same: the prefix index relies on it
  event.pool = name();
  event.page_size = static_cast<uint32_t>(options_.page_size);
  options_.events->Record(std::move(event));
}

void Pool::AnnounceStoredPages(Sequence* seq) {
  const size_t complete =
      std::min<size_t>(seq->length() / static_cast<uint32_t>(options_.page_size), seq->pages().size());
  if (seq->pages_announced() >= complete) {
    seq->set_pages_announced(std::max<uint32_t>(seq->pages_announced(), static_cast<uint32_t>(complete)));
    return;
  }
  // The hash of page-table entry i: the client's (pending until indexed),
  // or the index's -- neither looked up when there is none at all (no
  // client sent hashes): a 4,096-page append then reads no per-page hash
  // (its commit 11.2 -> 9.7-10.0 us on the development VM).
  const bool any_hash = !seq->pending_hashes().empty() || prefix_.size() > 0;
  const auto hash_of = [&](size_t i) -> std::string {
    if (!any_hash) return std::string();
    if (auto it = seq->pending_hashes().find(static_cast<uint32_t>(i)); it != seq->pending_hashes().end()) {
      return it->second;
    }
    const std::string* indexed = prefix_.HashOf(seq->pages()[i]);
    return indexed == nullptr ? std::string() : *indexed;
  };
  // A run's block_hashes stay empty until one of its pages has a hash (then
  // the pages before it get empty ones): a 4096-page prefill without hashes
  // builds no strings.
  KvEvent run;
  const auto flush = [&] {
    if (run.pages.empty()) return;
    run.kind = KvEvent::Kind::kStored;
    run.sequence = seq->id();
    if (!run.block_hashes.empty()) run.block_hashes.resize(run.pages.size());
    RecordEvent(std::move(run));
    run = KvEvent();
  };
  for (size_t i = seq->pages_announced(); i < complete; ++i) {
    const int32_t page = seq->pages()[i];
    if (page_stored_[page]) {  // announced by another holder (a fork's shared page)
      flush();
      continue;
    }
    page_stored_[page] = 1;
    if (run.pages.empty()) {
      run.first_page_index = static_cast<uint32_t>(i);
      if (i > 0) run.parent_block_hash = hash_of(i - 1);
    }
    run.pages.push_back(page);
    std::string hash = hash_of(i);
    if (!hash.empty() || !run.block_hashes.empty()) {
      run.block_hashes.resize(run.pages.size() - 1);
      run.block_hashes.push_back(std::move(hash));
    }
  }
  flush();
  seq->set_pages_announced(static_cast<uint32_t>(complete));
}

void Pool::WithdrawPages(Sequence* seq, size_t first, size_t last, const char* reason) {
  last = std::min(last, seq->pages().size());
  if (first < seq->pages_announced()) seq->set_pages_announced(static_cast<uint32_t>(first));
  KvEvent removed;
  removed.kind = KvEvent::Kind::kRemoved;
  removed.sequence = seq->id();
  removed.reason = reason;
  bool any_hash = false;
  for (size_t i = first; i < last; ++i) {
    const int32_t page = seq->pages()[i];
    if (!page_stored_[page] || allocator_->refs(page) > 1) continue;  // shared bytes stay as announced
    page_stored_[page] = 0;
    removed.pages.push_back(page);
    const std::string* hash = prefix_.HashOf(page);
    removed.block_hashes.push_back(hash == nullptr ? std::string() : *hash);
    any_hash = any_hash || hash != nullptr;
  }
  if (removed.pages.empty()) return;
  if (!any_hash) removed.block_hashes.clear();
  RecordEvent(std::move(removed));
}

}  // namespace mlakv::server
