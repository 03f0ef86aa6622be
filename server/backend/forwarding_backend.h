// ForwardingBackend: a CacheBackend that hands every call to another one.
// Wrappers (metrics' kernel timing, benches and tests that watch or skip the
// writes) derive from it and override only the calls they change.
#pragma once

#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "server/backend/cache_backend.h"

namespace mlakv::server {

class ForwardingBackend : public CacheBackend {
 public:
  explicit ForwardingBackend(std::unique_ptr<CacheBackend> inner) : inner_(std::move(inner)) {}

  Device device() const override { return inner_->device(); }
  uint64_t cache_bytes() const override { return inner_->cache_bytes(); }
  absl::Status Append(std::span<const LayerAppend> layers) override { return inner_->Append(layers); }
  absl::Status ReadEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& out) override {
    return inner_->ReadEntries(layer, entries, out);
  }
  absl::Status WriteEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& in) override {
    return inner_->WriteEntries(layer, entries, in);
  }
  absl::StatusOr<std::vector<LayerHandles>> ExportHandles() const override { return inner_->ExportHandles(); }
  absl::StatusOr<bool> EventsComplete(std::span<const void* const> events) override {
    return inner_->EventsComplete(events);
  }

 protected:
  CacheBackend& inner() { return *inner_; }

 private:
  std::unique_ptr<CacheBackend> inner_;
};

}  // namespace mlakv::server
