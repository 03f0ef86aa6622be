#include "server/core/append_transaction.h"

#include "server/core/pool.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {

AppendTransaction::AppendTransaction(Pool* pool, Sequence* sequence, std::string id, int32_t num_layers)
    : pool_(pool),
      sequence_(sequence),
      id_(std::move(id)),
      per_layer_(2 * static_cast<size_t>(num_layers), 0) {
  const size_t n = static_cast<size_t>(num_layers);
  staged_end_ = std::span<uint32_t>(per_layer_.data(), n);
  touched_ = std::span<uint32_t>(per_layer_.data() + n, n);
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
