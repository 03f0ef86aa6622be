#include "server/observability/instrumented_backend.h"

#include <chrono>

namespace mlakv::server {

absl::Status InstrumentedBackend::Append(std::span<const LayerAppend> layers) {
  auto t0 = std::chrono::steady_clock::now();
  absl::Status s = inner().Append(layers);
  metrics_->KernelRan(pool_, device_, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return s;
}

}  // namespace mlakv::server
