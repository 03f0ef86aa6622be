// The one place that knows both backends: the backend a device calls for.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "server/backend/cache_backend.h"
#include "server/backend/device.h"

namespace mlakv::server {

// The cpu or cuda backend of `device` (which must exist: Device::CheckExists),
// caches zeroed.
absl::StatusOr<std::unique_ptr<CacheBackend>> CreateCacheBackend(const Device& device,
                                                                 const CacheBackend::Geometry& geometry);

}  // namespace mlakv::server
