// KvCacheService: the RPC surface of mlakv.v1.KvCache, every method on the
// server's one completion queue (server/cq/; docs/server.md "Threads").
//
// Why the completion-queue API alone: gRPC 1.51 on Linux polls every socket
// of the process through one epoll set, and a callback-API service (or a
// synchronous one) brings threads that poll it beside the server's own; a
// request read on one of them is handed over to the thread that serves it,
// ~50 us a call on the GPU host (docs/performance.md "The callback API's
// threads"). Here the thread that reads a request runs its handler:
//  * Unary queries run inline on that thread and touch metadata under a
//    pool's mutex for a moment.
//  * Calls that touch cache memory (AppendBatch, ForkSequence) run as one of
//    the pool's worker tasks: on the calling thread at once when the worker
//    is idle (SerialExecutor::RunOrPost), else queued behind the running
//    task and finished from the worker; no queue thread waits for a pool.
//  * Streams (Append: AppendReactor, ReadSequence: ReadReactor,
//    WatchEvents: WatchEventsReactor) are call objects driven like gRPC's
//    reactors (cq/calls.h); region registrations open and map on the
//    registry's worker and finish from there.
//
// Append is a raw method (ByteBuffer in and out): the reactor parses each
// message itself, so that a message that does not parse fails the stream
// (and rolls it back) instead of reading as a clean end of stream
// (docs/reliability.md "Atomic streams").
// absl::Status becomes grpc::Status only through ToGrpcStatus.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"
#include "server/core/kv_events.h"
#include "server/cq/calls.h"
#include "server/cq/queue_threads.h"
#include "server/observability/server_metrics.h"
#include "server/core/pool.h"
#include "server/regions/region_registry.h"
#include "server/core/serial_executor.h"
#include "server/rpc/append_wire.h"
#include "server/rpc/open_appends.h"
#include "server/rpc/stream_watchdog.h"

namespace mlakv::server {

// What one Append or AppendBatch call did, for metrics.
struct AppendOutcome {
  const char* method = "";   // "Append" or "AppendBatch"
  std::string pool;          // the pool's name; empty when the call named no existing pool
  bool ok = false;           // committed
  uint64_t rows = 0;         // rows written (per layer), when ok
  uint64_t bytes = 0;        // ckv + kpe bytes carried in the messages, when ok
  double seconds = 0;        // from the call's start to its status
};

// Every method on the completion-queue API; Append raw; AppendBatch's
// request received with its rows left in the transport's slices
// (ReceivedAppendBatch, server/rpc/append_wire.h).
class KvCacheAsyncService final : public v1::KvCache::WithRawMethod_Append<v1::KvCache::AsyncService> {
 public:
  KvCacheAsyncService();
  // The generated RequestAppendBatch, filling a ReceivedAppendBatch.
  void RequestAppendBatchReceived(grpc::ServerContext* context, ReceivedAppendBatch* request,
                                  grpc::ServerAsyncResponseWriter<v1::AppendBatchResponse>* response,
                                  grpc::CompletionQueue* new_call_cq, grpc::ServerCompletionQueue* notification_cq,
                                  void* tag) {
    RequestAsyncUnary(append_batch_index_, context, request, response, new_call_cq, notification_cq, tag);
  }

 private:
  const int append_batch_index_;  // gRPC's index of the method: its place in the proto's service
};

// The unary calls whose handlers finish them later, from a worker.
using AppendBatchCall = cq::UnaryCall<ReceivedAppendBatch, v1::AppendBatchResponse>;
using ForkSequenceCall = cq::UnaryCall<v1::ForkSequenceRequest, v1::ForkSequenceResponse>;
using RegisterShmRegionCall = cq::UnaryCall<v1::RegisterShmRegionRequest, v1::Region>;
using RegisterCudaRegionCall = cq::UnaryCall<v1::RegisterCudaRegionRequest, v1::Region>;
using CommitAppendCall = cq::UnaryCall<v1::CommitAppendRequest, v1::AppendResponse>;

class KvCacheService final {
 public:
  // The unary methods, whose per-RPC metrics the service records itself
  // (RpcScope) instead of gRPC's interceptor: the interceptor machinery cost
  // ~15-20 us a call on the GPU host (docs/performance.md "Issue 16"), a
  // tenth of a GetPool. The streams and region registrations keep the
  // interceptor.
  enum RpcMethod {
    kRpcListPools, kRpcGetPool, kRpcAppendBatch, kRpcGetSequence, kRpcListSequences, kRpcGetPage,
    kRpcFreeSequence, kRpcTruncateSequence, kRpcUnregisterRegion, kRpcListRegions, kRpcExportPool,
    kRpcAcquireLease, kRpcRenewLease, kRpcReleaseLease, kRpcListLeases, kRpcForkSequence, kRpcMatchPrefix,
    kRpcCommitAppend, kRpcMethods
  };
  // Their paths ("/mlakv.v1.KvCache/GetPool"), in RpcMethod order.
  static std::vector<std::string> SelfRecordedPaths();

  // One synchronous call's metrics: started when the handler begins, finished
  // with the status it returns.
  class RpcScope {
   public:
    RpcScope(ServerMetrics* metrics, ServerMetrics::RpcChildren* children);
    grpc::Status Done(grpc::Status status);

   private:
    ServerMetrics* metrics_;
    ServerMetrics::RpcChildren* children_;
    std::chrono::steady_clock::time_point start_;
  };

  struct Options {
    std::vector<Pool*> pools;   // not owned; outlive the service
    std::string default_pool;   // the pool an empty `pool` field means
    uint32_t max_message_bytes = 64 << 20;  // largest message received and sent
    RegionRegistry* regions = nullptr;  // not owned, outlives the service; never null
    // An Append stream that delivers no message for this long is ended
    // (DEADLINE_EXCEEDED) and rolled back.
    absl::Duration append_idle_timeout = absl::Seconds(60);
    // Called once per Append / AppendBatch call when it ends (metrics); may be empty.
    std::function<void(const AppendOutcome&)> on_append;
    // The KV events WatchEvents streams (not owned; null: WatchEvents is
    // UNIMPLEMENTED), the server's id they carry, and how many streams may
    // be open at once.
    EventLog* events = nullptr;
    std::string server_id;
    int max_watchers = 64;
    // Per-RPC metrics of the synchronous methods (not owned); null: none.
    ServerMetrics* metrics = nullptr;
    // Tests only: runs on the pool's worker when an Append stream's commit
    // has passed its last check, just before the pool commits it (to hold a
    // commit in that window while the test races a message or a call).
    std::function<void()> after_last_check_for_testing;
  };

  explicit KvCacheService(Options options);
  ~KvCacheService();

  // What the ServerBuilder registers.
  grpc::Service* grpc_service() { return &async_; }
  // Serves every method on `queue` (the server's; it outlives every call)
  // from now on (kv_cache_methods.cc). After the server started.
  void Serve(cq::QueueThreads* queue);
  KvCacheAsyncService* async() { return &async_; }

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

  // ---- what the reactors share ----
  const Options& options() const { return options_; }
  StreamWatchdog& watchdog() { return *watchdog_; }
  // The open Append streams CommitAppend can name.
  OpenAppends& open_appends() { return open_appends_; }
  // Runs the rollback of a stream that timed out before it named a pool.
  SerialExecutor& control() { return *control_; }
  // The transport's side of an Append stream once a pool's worker has
  // staged a message: giving the message's slices back, starting the next
  // read, Finish (which may write the response inline). Kept off the pool's
  // worker so it goes straight on to the next message's staging
  // (docs/performance.md "Ingest: the transport's work off the worker").
  // Round robin over a few threads; a stream keeps the one it got.
  SerialExecutor& NextTransport();
  // The transport threads' load, summed (for the metrics).
  SerialExecutor::Load TransportLoad() const;
  void AppendStarted() { appends_in_flight_.fetch_add(1); }
  void AppendEnded(const AppendOutcome& outcome);
  // A WatchEvents stream opens: counted in watchers() until WatcherEnded,
  // refused or not. Not OK: why it is refused (draining, no event log, the
  // server's limit of streams).
  absl::Status WatcherStarted();
  void WatcherEnded() { watchers_.fetch_sub(1); }

  // ---- the handlers (kv_cache_methods.cc binds each to its method) ----
  grpc::Status ListPools(cq::CallContext* ctx, const v1::ListPoolsRequest* req, v1::ListPoolsResponse* resp);
  grpc::Status GetPool(cq::CallContext* ctx, const v1::GetPoolRequest* req, v1::Pool* resp);
  // A decode step or prefill batch: on the pool's worker (RunOrPost).
  void AppendBatch(AppendBatchCall* call);
  grpc::Status GetSequence(cq::CallContext* ctx, const v1::GetSequenceRequest* req, v1::Sequence* resp);
  grpc::Status ListSequences(cq::CallContext* ctx, const v1::ListSequencesRequest* req,
                             v1::ListSequencesResponse* resp);
  grpc::Status GetPage(cq::CallContext* ctx, const v1::GetPageRequest* req, v1::Page* resp);
  int watchers() const { return watchers_.load(); }
  grpc::Status FreeSequence(cq::CallContext* ctx, const v1::FreeSequenceRequest* req,
                            v1::FreeSequenceResponse* resp);
  grpc::Status TruncateSequence(cq::CallContext* ctx,
                                const v1::TruncateSequenceRequest* req, v1::Sequence* resp);
  // Regions: opened and mapped on the registry's worker (shm_open + mmap,
  // cudaIpcOpenMemHandle), finished from there.
  void RegisterShmRegion(RegisterShmRegionCall* call);
  void RegisterCudaRegion(RegisterCudaRegionCall* call);
  grpc::Status UnregisterRegion(cq::CallContext* ctx, const v1::UnregisterRegionRequest* req,
                                v1::UnregisterRegionResponse* resp);
  grpc::Status ListRegions(cq::CallContext* ctx, const v1::ListRegionsRequest* req,
                           v1::ListRegionsResponse* resp);
  grpc::Status ExportPool(cq::CallContext* ctx, const v1::ExportPoolRequest* req,
                          v1::ExportPoolResponse* resp);
  // Cache management (cache_management_calls.cc): leases and MatchPrefix
  // under the pool's mutex, inline; ForkSequence on the pool's worker (it
  // may copy a partial page).
  grpc::Status AcquireLease(cq::CallContext* ctx, const v1::AcquireLeaseRequest* req, v1::Lease* resp);
  grpc::Status RenewLease(cq::CallContext* ctx, const v1::RenewLeaseRequest* req, v1::Lease* resp);
  grpc::Status ReleaseLease(cq::CallContext* ctx, const v1::ReleaseLeaseRequest* req,
                            v1::ReleaseLeaseResponse* resp);
  grpc::Status ListLeases(cq::CallContext* ctx, const v1::ListLeasesRequest* req,
                          v1::ListLeasesResponse* resp);
  void ForkSequence(ForkSequenceCall* call);
  grpc::Status MatchPrefix(cq::CallContext* ctx, const v1::MatchPrefixRequest* req,
                           v1::MatchPrefixResponse* resp);
  // Commits the open Append stream its commit_token names, answered when
  // that stream ends (commit_append_call.cc).
  void CommitAppend(CommitAppendCall* call);

 private:
  // The unary prelude: UNAVAILABLE while draining, INVALID_ARGUMENT for an
  // over-long pool name, then the pool (NOT_FOUND).
  absl::StatusOr<Pool*> Prelude(const std::string& pool) const;
  RpcScope StartRpc(RpcMethod method) { return RpcScope(options_.metrics, rpc_children_[method]); }

  const Options options_;
  KvCacheAsyncService async_;
  // The unary methods' bindings (kv_cache_methods.cc), alive as long as the
  // calls that point to them: the queue is shut down before the service goes.
  std::vector<std::shared_ptr<void>> methods_;
  std::atomic<bool> draining_{false};
  std::atomic<int> appends_in_flight_{0};
  std::atomic<int> watchers_{0};
  ServerMetrics::RpcChildren* rpc_children_[kRpcMethods] = {};  // resolved once (null without metrics)
  std::unique_ptr<SerialExecutor> control_;
  std::vector<std::unique_ptr<SerialExecutor>> transport_;
  std::atomic<size_t> next_transport_{0};
  std::unique_ptr<StreamWatchdog> watchdog_;  // after control_: destroyed first
  OpenAppends open_appends_;
};

}  // namespace mlakv::server
