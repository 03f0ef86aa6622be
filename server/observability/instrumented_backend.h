// InstrumentedBackend: a CacheBackend that forwards to another and reports
// the time of every Append (the quantize-append: for CUDA, staging copies,
// kernel and stream synchronization, since Append returns only when the work
// is complete) to ServerMetrics as mlakv_kernel_*{pool,device}.
#pragma once

#include <memory>
#include <string>

#include "server/backend/forwarding_backend.h"
#include "server/observability/server_metrics.h"

namespace mlakv::server {

class InstrumentedBackend final : public ForwardingBackend {
 public:
  // `metrics` is not owned and outlives the backend.
  InstrumentedBackend(std::unique_ptr<CacheBackend> inner, std::string pool, ServerMetrics* metrics)
      : ForwardingBackend(std::move(inner)), pool_(std::move(pool)), device_(device().ToString()), metrics_(metrics) {}

  absl::Status Append(std::span<const LayerAppend> layers) override;

 private:
  const std::string pool_;
  const std::string device_;  // the metrics' device label
  ServerMetrics* const metrics_;
};

}  // namespace mlakv::server
