#include "server/core/append_transaction.h"

#include <algorithm>

#include "common/quote.h"
#include "server/core/pool.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {

AppendTransaction::AppendTransaction(Pool* pool, Sequence* sequence, std::string id, int32_t num_layers)
    : pool_(pool),
      sequence_(sequence),
      id_(std::move(id)),
      num_layers_(static_cast<uint32_t>(num_layers)) {
  original_pages_ = sequence->pages().size();
}

void AppendTransaction::MakePerLayer() {
  if (!per_layer_.empty()) return;
  per_layer_.assign(2 * static_cast<size_t>(num_layers_), 0);
  staged_end_ = std::span<uint32_t>(per_layer_.data(), num_layers_);
  touched_ = std::span<uint32_t>(per_layer_.data() + num_layers_, num_layers_);
  if (touched_every_layer()) std::fill(touched_.begin(), touched_.end(), 1u);
}

std::span<const uint32_t> AppendTransaction::staged_ends() {
  if (level_end_) {
    MakePerLayer();
    std::fill(staged_end_.begin(), staged_end_.end(), *level_end_);
    level_end_.reset();
  }
  return staged_end_;
}

bool AppendTransaction::Touch(int32_t layer) {
  if (touched(layer)) return false;
  MakePerLayer();
  touched_[layer] = 1;
  ++touched_layers_;
  return true;
}

void AppendTransaction::StageEveryLayer(uint32_t end) {
  if (level_end_) {
    level_end_ = std::max(*level_end_, end);
  } else {
    for (uint32_t& e : staged_end_) e = std::max(e, end);
  }
}

void AppendTransaction::StageLayer(int32_t layer, uint32_t end) {
  staged_ends();  // the ends differ from here on (or may)
  staged_end_[layer] = std::max(staged_end_[layer], end);
}

size_t AppendTransaction::first_changed_page() const {
  size_t first = original_pages_;
  for (const CopyOnWrite& c : cows_) first = std::min<size_t>(first, c.index);
  return first;
}

AppendTransaction::~AppendTransaction() {
  if (!finished_) {
    spdlog::error("append to sequence {} of pool {} was neither committed nor aborted; aborting it now", Quote(id_),
                  Quote(pool_->name()));
    pool_->Abort(*this);
  }
}

}  // namespace mlakv::server
