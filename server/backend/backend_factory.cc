#include "server/backend/backend_factory.h"

#include "common/status_macros.h"
#include "server/backend/cpu_backend.h"
#include "server/backend/cuda_backend.h"

namespace mlakv::server {

absl::StatusOr<std::unique_ptr<CacheBackend>> CreateCacheBackend(const Device& device,
                                                                 const CacheBackend::Geometry& geometry,
                                                                 const BackendLimits& limits) {
  MLAKV_RETURN_IF_ERROR(device.CheckExists());
  if (!device.is_cuda()) {
    MLAKV_ASSIGN_OR_RETURN(std::unique_ptr<CpuBackend> cpu, CpuBackend::Create({.geometry = geometry}));
    return std::unique_ptr<CacheBackend>(std::move(cpu));
  }
  MLAKV_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> cuda,
                         CudaBackend::Create({.geometry = geometry, .device = device, .source_timeout = limits.source_timeout}));
  return std::unique_ptr<CacheBackend>(std::move(cuda));
}

}  // namespace mlakv::server
