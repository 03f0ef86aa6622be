// The one place that knows both backends: the backend a device calls for.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/backend/cache_backend.h"
#include "server/backend/device.h"

namespace mlakv::server {

// What bounds a backend's waits.
struct BackendLimits {
  // Longest the cuda backend waits for a producer's CUDA event before it
  // reads the rows behind it (CudaBackend::Options::source_timeout).
  absl::Duration source_timeout = absl::Seconds(60);
};

// The cpu or cuda backend of `device` (which must exist: Device::CheckExists),
// caches zeroed.
absl::StatusOr<std::unique_ptr<CacheBackend>> CreateCacheBackend(const Device& device,
                                                                 const CacheBackend::Geometry& geometry,
                                                                 const BackendLimits& limits = {});

}  // namespace mlakv::server
