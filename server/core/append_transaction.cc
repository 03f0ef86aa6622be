#include "server/core/append_transaction.h"

#include <algorithm>

#include "server/core/pool.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {

AppendTransaction::AppendTransaction(Pool* pool, Sequence* sequence, std::string id, int32_t num_layers)
    : pool_(pool),
      sequence_(sequence),
      id_(std::move(id)),
      per_layer_(3 * static_cast<size_t>(num_layers), 0) {
  const size_t n = static_cast<size_t>(num_layers);
  committed_ = std::span<uint32_t>(per_layer_.data(), n);
  staged_end_ = std::span<uint32_t>(per_layer_.data() + n, n);
  touched_ = std::span<uint32_t>(per_layer_.data() + 2 * n, n);
  // One pass copies the lengths and finds their least and most.
  const std::vector<uint32_t>& lengths = sequence->layer_lengths();
  uint32_t lo = n > 0 ? UINT32_MAX : 0, hi = 0;
  for (size_t l = 0; l < n; ++l) {
    const uint32_t len = lengths[l];
    committed_[l] = len;
    lo = std::min(lo, len);
    hi = std::max(hi, len);
  }
  committed_min_ = lo;
  committed_max_ = hi;
  original_pages_ = sequence->pages().size();
}

AppendTransaction::~AppendTransaction() {
  if (!finished_) {
    spdlog::error("append to sequence '{}' of pool '{}' was neither committed nor aborted; aborting it now", id_,
                  pool_->name());
    pool_->Abort(*this);
  }
}

}  // namespace mlakv::server
