// InstrumentedBackend: a CacheBackend that forwards to another and reports
// the time of every Append (the quantize-append: for CUDA, staging copies,
// kernel and stream synchronization, since Append returns only when the work
// is complete) to ServerMetrics as mlakv_kernel_*{pool,device}.
#pragma once

#include <memory>
#include <string>

#include "server/backend/cache_backend.h"
#include "server/observability/server_metrics.h"

namespace mlakv::server {

class InstrumentedBackend final : public CacheBackend {
 public:
  // `metrics` is not owned and outlives the backend.
  InstrumentedBackend(std::unique_ptr<CacheBackend> inner, std::string pool, ServerMetrics* metrics)
      : inner_(std::move(inner)), pool_(std::move(pool)), device_(inner_->device()), metrics_(metrics) {}

  Device device() const override { return device_; }
  uint64_t cache_bytes() const override { return inner_->cache_bytes(); }
  absl::Status Append(std::span<const LayerAppend> layers) override;
  absl::Status ReadEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& out) override {
    return inner_->ReadEntries(layer, entries, out);
  }
  absl::Status WriteEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& in) override {
    return inner_->WriteEntries(layer, entries, in);
  }
  absl::StatusOr<std::vector<LayerHandles>> ExportHandles() const override { return inner_->ExportHandles(); }

 private:
  std::unique_ptr<CacheBackend> inner_;
  const std::string pool_;
  const Device device_;
  ServerMetrics* const metrics_;
};

}  // namespace mlakv::server
