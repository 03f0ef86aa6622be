#include "server/core/append_transaction.h"

#include "server/core/pool.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {

AppendTransaction::AppendTransaction(Pool* pool, Sequence* sequence, std::string id, int32_t num_layers)
    : pool_(pool),
      sequence_(sequence),
      id_(std::move(id)),
      committed_(sequence->layer_lengths()),
      staged_end_(num_layers, 0),
      touched_(num_layers, false) {
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
