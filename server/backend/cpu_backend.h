// CpuBackend: a pool's caches in host memory, written by the CPU
// implementation of the quantize-append kernel (QuantizeAppendHost).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "server/backend/cache_backend.h"

namespace mlakv::server {

class CpuBackend : public CacheBackend {
 public:
  struct Options {
    Geometry geometry;
    int num_threads = 0;  // host threads per quantize call; <= 0: hardware concurrency
  };

  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(const Options& options);
  ~CpuBackend() override;

  Device device() const override { return Device::Cpu(); }
  uint64_t cache_bytes() const override;
  absl::Status Append(std::span<const LayerAppend> layers) override;
  absl::Status ReadEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& out) override;
  absl::Status WriteEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& in) override;

 private:
  struct LayerCaches {
    uint8_t* ckv = nullptr;  // [num_pages, page_size, 256]
    uint8_t* sf = nullptr;   // [num_pages, page_size, 32]
    uint8_t* kpe = nullptr;  // [num_pages, page_size, 64]
  };

  explicit CpuBackend(const Options& options) : options_(options) {}
  absl::Status CheckEntries(int32_t layer, std::span<const int64_t> entries) const;

  Options options_;
  std::vector<LayerCaches> layers_;
};

}  // namespace mlakv::server
