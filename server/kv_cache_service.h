// KvCacheService: the RPC surface of mlakv.v1.KvCache (callback API).
//
// Unary queries (ListPools, GetPool, GetSequence, ListSequences, GetPage,
// FreeSequence, TruncateSequence) touch metadata under a pool's mutex for a
// moment and finish inline through context->DefaultReactor(). Everything that
// touches cache memory -- Append (a reactor per stream), AppendBatch and
// ReadSequence (a reactor per stream) -- runs on the pool's worker, so no
// reaction ever waits on quantization or a CUDA synchronization.
// absl::Status becomes grpc::Status only through ToGrpcStatus.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"
#include "server/pool.h"
#include "server/region_registry.h"

namespace mlakv::server {

class KvCacheService final : public mlakv::v1::KvCache::CallbackService {
 public:
  struct Options {
    std::vector<Pool*> pools;   // not owned; outlive the service
    std::string default_pool;   // the pool an empty `pool` field means
    uint32_t max_message_bytes = 64 << 20;  // largest message sent (ReadSequence chunks are capped below it)
    RegionRegistry* regions = nullptr;  // not owned, outlives the service; never null
  };

  explicit KvCacheService(Options options);

  // From now on every new call is refused with UNAVAILABLE; calls in flight
  // (an open Append stream included) run to their end.
  void StartDraining() { draining_.store(true); }
  bool draining() const { return draining_.load(); }
  // Appends (Append streams, AppendBatch calls) accepted and not yet
  // finished: what a drain waits for before the grpc::Server shuts down, so
  // that until then every new call gets this service's UNAVAILABLE rather
  // than whatever a closing transport says (CANCELLED).
  int appends_in_flight() const { return appends_in_flight_.load(); }

  // The pool `name` names (empty: the default), or NOT_FOUND listing the pools.
  absl::StatusOr<Pool*> FindPool(const std::string& name) const;

  grpc::ServerUnaryReactor* ListPools(grpc::CallbackServerContext* ctx, const v1::ListPoolsRequest* req,
                                      v1::ListPoolsResponse* resp) override;
  grpc::ServerUnaryReactor* GetPool(grpc::CallbackServerContext* ctx, const v1::GetPoolRequest* req,
                                    v1::Pool* resp) override;
  grpc::ServerReadReactor<v1::AppendRequest>* Append(grpc::CallbackServerContext* ctx,
                                                     v1::AppendResponse* resp) override;
  grpc::ServerUnaryReactor* AppendBatch(grpc::CallbackServerContext* ctx, const v1::AppendBatchRequest* req,
                                        v1::AppendBatchResponse* resp) override;
  grpc::ServerUnaryReactor* GetSequence(grpc::CallbackServerContext* ctx, const v1::GetSequenceRequest* req,
                                        v1::Sequence* resp) override;
  grpc::ServerUnaryReactor* ListSequences(grpc::CallbackServerContext* ctx, const v1::ListSequencesRequest* req,
                                          v1::ListSequencesResponse* resp) override;
  grpc::ServerUnaryReactor* GetPage(grpc::CallbackServerContext* ctx, const v1::GetPageRequest* req,
                                    v1::Page* resp) override;
  grpc::ServerWriteReactor<v1::ReadSequenceResponse>* ReadSequence(grpc::CallbackServerContext* ctx,
                                                                   const v1::ReadSequenceRequest* req) override;
  grpc::ServerUnaryReactor* FreeSequence(grpc::CallbackServerContext* ctx, const v1::FreeSequenceRequest* req,
                                         v1::FreeSequenceResponse* resp) override;
  grpc::ServerUnaryReactor* TruncateSequence(grpc::CallbackServerContext* ctx,
                                             const v1::TruncateSequenceRequest* req, v1::Sequence* resp) override;
  // Regions: inline (shm_open + mmap, cudaIpcOpenMemHandle happen once per registration).
  grpc::ServerUnaryReactor* RegisterShmRegion(grpc::CallbackServerContext* ctx, const v1::RegisterShmRegionRequest* req,
                                              v1::Region* resp) override;
  grpc::ServerUnaryReactor* RegisterCudaRegion(grpc::CallbackServerContext* ctx,
                                               const v1::RegisterCudaRegionRequest* req, v1::Region* resp) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* ctx, const v1::UnregisterRegionRequest* req,
                                             v1::UnregisterRegionResponse* resp) override;
  grpc::ServerUnaryReactor* ListRegions(grpc::CallbackServerContext* ctx, const v1::ListRegionsRequest* req,
                                        v1::ListRegionsResponse* resp) override;
  grpc::ServerUnaryReactor* ExportPool(grpc::CallbackServerContext* ctx, const v1::ExportPoolRequest* req,
                                       v1::ExportPoolResponse* resp) override;

 private:
  class AppendReactor;
  class ReadReactor;

  const Options options_;
  std::atomic<bool> draining_{false};
  std::atomic<int> appends_in_flight_{0};
};

}  // namespace mlakv::server
