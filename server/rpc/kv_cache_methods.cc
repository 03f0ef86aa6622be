// KvCacheService::Serve: which handler each mlakv.v1.KvCache method runs on
// the server's completion queue, and how (cq/calls.h):
//  * a handler that returns its status runs on the queue thread that took
//    the call, which then finishes it;
//  * a handler that takes the call (AppendBatch, ForkSequence, CommitAppend, the region
//    registrations) finishes it itself, there or later from a worker;
//  * the streams are call objects of their own (AppendReactor, ReadReactor,
//    WatchEventsReactor).
#include <memory>

#include "server/rpc/append_reactor.h"
#include "server/rpc/kv_cache_service.h"
#include "server/rpc/read_reactor.h"
#include "server/rpc/watch_events_reactor.h"

namespace mlakv::server {
namespace {

// A generated RequestXxx of a unary method (a member of one of
// KvCacheAsyncService's bases).
template <class Req, class Resp>
using RequestFn = void (KvCacheAsyncService::*)(grpc::ServerContext*, Req*, grpc::ServerAsyncResponseWriter<Resp>*,
                                                 grpc::CompletionQueue*, grpc::ServerCompletionQueue*, void*);

// Binds a unary method, keeps the binding in `methods` (it must outlive the
// method's calls) and arms its first call.
// `requests` / `responses` (optional): free lists the method's calls take
// their messages from, kept beside the binding (cq/message_recycler.h).
template <class Req, class Resp>
void ServeUnary(KvCacheAsyncService* async, cq::QueueThreads* queue, std::vector<std::shared_ptr<void>>* methods,
                RequestFn<Req, Resp> request, std::function<void(cq::UnaryCall<Req, Resp>*)> handle,
                std::shared_ptr<cq::MessageRecycler<Req>> requests = nullptr,
                std::shared_ptr<cq::MessageRecycler<Resp>> responses = nullptr) {
  auto method = std::make_shared<typename cq::UnaryCall<Req, Resp>::Method>();
  method->requests = requests.get();
  method->responses = responses.get();
  if (requests != nullptr) methods->push_back(std::move(requests));
  if (responses != nullptr) methods->push_back(std::move(responses));
  method->request = [async, queue, request](grpc::ServerContext* ctx, Req* req,
                                            grpc::ServerAsyncResponseWriter<Resp>* responder, void* tag) {
    (async->*request)(ctx, req, responder, queue->queue(), queue->queue(), tag);
  };
  method->handle = std::move(handle);
  methods->push_back(method);
  cq::UnaryCall<Req, Resp>::Serve(queue, method.get());
}

// How many of AppendBatch's requests and responses are kept for the next
// calls, and which responses: those within the requests' bound (KeepForReuse,
// append_wire.h), in sequences and in bytes.
constexpr size_t kRecycledMessages = 8;

bool KeepResponseForReuse(const v1::AppendBatchResponse& r) {
  return r.sequences_size() <= kReuseMaxEntries && r.ByteSizeLong() <= kReuseMaxBytes;
}

}  // namespace

// gRPC numbers a service's methods in the order the proto declares them
// (the generated RequestXxx pass that number), which is the method
// descriptor's index.
KvCacheAsyncService::KvCacheAsyncService()
    : append_batch_index_(v1::AppendBatchRequest::descriptor()
                              ->file()
                              ->FindServiceByName("KvCache")
                              ->FindMethodByName("AppendBatch")
                              ->index()) {}

void KvCacheService::Serve(cq::QueueThreads* queue) {
  // A handler that returns its status.
  auto inline_handler = [this](auto handler) {
    return [this, handler](auto* call) { call->Finish((this->*handler)(call->context(), &call->request(), call->response())); };
  };
  // A handler that finishes the call itself.
  auto call_handler = [this](auto handler) { return [this, handler](auto* call) { (this->*handler)(call); }; };
  auto* async = &async_;
  auto* m = &methods_;
  using S = KvCacheAsyncService;
  namespace pb = v1;

  ServeUnary<pb::ListPoolsRequest, pb::ListPoolsResponse>(async, queue, m, &S::RequestListPools,
                                                          inline_handler(&KvCacheService::ListPools));
  ServeUnary<pb::GetPoolRequest, pb::Pool>(async, queue, m, &S::RequestGetPool, inline_handler(&KvCacheService::GetPool));
  ServeUnary<ReceivedAppendBatch, pb::AppendBatchResponse>(
      async, queue, m, &S::RequestAppendBatchReceived, call_handler(&KvCacheService::AppendBatch),
      std::make_shared<cq::MessageRecycler<ReceivedAppendBatch>>(kRecycledMessages, KeepForReuse),
      std::make_shared<cq::MessageRecycler<pb::AppendBatchResponse>>(kRecycledMessages, KeepResponseForReuse));
  ServeUnary<pb::GetSequenceRequest, pb::Sequence>(async, queue, m, &S::RequestGetSequence,
                                                   inline_handler(&KvCacheService::GetSequence));
  ServeUnary<pb::ListSequencesRequest, pb::ListSequencesResponse>(async, queue, m, &S::RequestListSequences,
                                                                  inline_handler(&KvCacheService::ListSequences));
  ServeUnary<pb::GetPageRequest, pb::Page>(async, queue, m, &S::RequestGetPage, inline_handler(&KvCacheService::GetPage));
  ServeUnary<pb::FreeSequenceRequest, pb::FreeSequenceResponse>(async, queue, m, &S::RequestFreeSequence,
                                                                inline_handler(&KvCacheService::FreeSequence));
  ServeUnary<pb::TruncateSequenceRequest, pb::Sequence>(async, queue, m, &S::RequestTruncateSequence,
                                                        inline_handler(&KvCacheService::TruncateSequence));
  ServeUnary<pb::RegisterShmRegionRequest, pb::Region>(async, queue, m, &S::RequestRegisterShmRegion,
                                                       call_handler(&KvCacheService::RegisterShmRegion));
  ServeUnary<pb::RegisterCudaRegionRequest, pb::Region>(async, queue, m, &S::RequestRegisterCudaRegion,
                                                        call_handler(&KvCacheService::RegisterCudaRegion));
  ServeUnary<pb::UnregisterRegionRequest, pb::UnregisterRegionResponse>(
      async, queue, m, &S::RequestUnregisterRegion, inline_handler(&KvCacheService::UnregisterRegion));
  ServeUnary<pb::ListRegionsRequest, pb::ListRegionsResponse>(async, queue, m, &S::RequestListRegions,
                                                              inline_handler(&KvCacheService::ListRegions));
  ServeUnary<pb::ExportPoolRequest, pb::ExportPoolResponse>(async, queue, m, &S::RequestExportPool,
                                                            inline_handler(&KvCacheService::ExportPool));
  ServeUnary<pb::AcquireLeaseRequest, pb::Lease>(async, queue, m, &S::RequestAcquireLease,
                                                 inline_handler(&KvCacheService::AcquireLease));
  ServeUnary<pb::RenewLeaseRequest, pb::Lease>(async, queue, m, &S::RequestRenewLease,
                                               inline_handler(&KvCacheService::RenewLease));
  ServeUnary<pb::ReleaseLeaseRequest, pb::ReleaseLeaseResponse>(async, queue, m, &S::RequestReleaseLease,
                                                                inline_handler(&KvCacheService::ReleaseLease));
  ServeUnary<pb::ListLeasesRequest, pb::ListLeasesResponse>(async, queue, m, &S::RequestListLeases,
                                                            inline_handler(&KvCacheService::ListLeases));
  ServeUnary<pb::ForkSequenceRequest, pb::ForkSequenceResponse>(async, queue, m, &S::RequestForkSequence,
                                                                call_handler(&KvCacheService::ForkSequence));
  ServeUnary<pb::MatchPrefixRequest, pb::MatchPrefixResponse>(async, queue, m, &S::RequestMatchPrefix,
                                                              inline_handler(&KvCacheService::MatchPrefix));
  ServeUnary<pb::CommitAppendRequest, pb::AppendResponse>(async, queue, m, &S::RequestCommitAppend,
                                                          call_handler(&KvCacheService::CommitAppend));
  AppendReactor::Serve(this, queue);
  ReadReactor::Serve(this, queue);
  WatchEventsReactor::Serve(this, queue);
}

}  // namespace mlakv::server
