// KvCacheService: the cache-management calls — leases, forks, prefix
// matches (docs/server.md "Leases", "Shared pages"). The pool does the
// work (server/core/pool_leases.cc, pool_sharing.cc); these handlers check
// the request's strings, convert, and map the status once.
#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "server/rpc/call_support.h"
#include "server/rpc/grpc_status.h"
#include "server/rpc/kv_cache_service.h"
#include "server/rpc/proto_convert.h"

namespace mlakv::server {
namespace {

std::string LeaseDetail(const std::string& pool, uint64_t lease_id) {
  return absl::StrCat("pool=", Quote(pool), " lease=", lease_id);
}

}  // namespace

grpc::Status KvCacheService::AcquireLease(cq::CallContext* ctx,
                                          const v1::AcquireLeaseRequest* req, v1::Lease* resp) {
  RpcScope scope = StartRpc(kRpcAcquireLease);
  const absl::Status status = [&]() -> absl::Status {
    MLAKV_ASSIGN_OR_RETURN(Pool * pool, Prelude(req->pool()));
    MLAKV_RETURN_IF_ERROR(CheckFieldLength("sequence", req->sequence(), kMaxSequenceIdBytes));
    MLAKV_RETURN_IF_ERROR(CheckCallAlive(ctx, "no lease was taken"));
    MLAKV_ASSIGN_OR_RETURN(LeaseSnapshot lease,
                           pool->AcquireLease(RefOf(*req), ToLeaseRequest(req->lease()), req->tokens()));
    ToProto(pool->name(), lease, resp);
    return absl::OkStatus();
  }();
  const auto detail = [&] {
    return absl::StrCat("pool=", Quote(req->pool()), " sequence=", Quote(req->sequence()), " holder=",
                        Quote(req->lease().holder()));
  };
  return scope.Done(FinishCall("AcquireLease", detail, status));
}

grpc::Status KvCacheService::RenewLease(cq::CallContext* ctx, const v1::RenewLeaseRequest* req, v1::Lease* resp) {
  RpcScope scope = StartRpc(kRpcRenewLease);
  const absl::Status status = [&]() -> absl::Status {
    MLAKV_ASSIGN_OR_RETURN(Pool * pool, Prelude(req->pool()));
    MLAKV_RETURN_IF_ERROR(CheckCallAlive(ctx, "the lease was not renewed"));
    MLAKV_ASSIGN_OR_RETURN(LeaseSnapshot lease,
                           pool->RenewLease(req->lease_id(), absl::Milliseconds(req->duration_ms())));
    ToProto(pool->name(), lease, resp);
    return absl::OkStatus();
  }();
  return scope.Done(FinishCall("RenewLease", [&] { return LeaseDetail(req->pool(), req->lease_id()); }, status));
}

grpc::Status KvCacheService::ReleaseLease(cq::CallContext* ctx,
                                          const v1::ReleaseLeaseRequest* req,
                                          v1::ReleaseLeaseResponse* resp) {
  RpcScope scope = StartRpc(kRpcReleaseLease);
  const absl::Status status = [&]() -> absl::Status {
    MLAKV_ASSIGN_OR_RETURN(Pool * pool, Prelude(req->pool()));
    MLAKV_RETURN_IF_ERROR(CheckCallAlive(ctx, "the lease was not released"));
    MLAKV_ASSIGN_OR_RETURN(uint32_t freed, pool->ReleaseLease(req->lease_id()));
    resp->set_pages_freed(freed);
    return absl::OkStatus();
  }();
  return scope.Done(FinishCall("ReleaseLease", [&] { return LeaseDetail(req->pool(), req->lease_id()); }, status));
}

grpc::Status KvCacheService::ListLeases(cq::CallContext*,
                                        const v1::ListLeasesRequest* req, v1::ListLeasesResponse* resp) {
  RpcScope scope = StartRpc(kRpcListLeases);
  const absl::Status status = [&]() -> absl::Status {
    MLAKV_ASSIGN_OR_RETURN(Pool * pool, Prelude(req->pool()));
    uint64_t after = 0;
    if (!req->page_token().empty() && !absl::SimpleAtoi(req->page_token(), &after)) {
      return absl::InvalidArgumentError(absl::StrCat("page_token ", Quote(req->page_token()),
                                                     " is not one a ListLeases response gave"));
    }
    const uint32_t limit =
        req->page_size() == 0 ? kDefaultListPageSize : std::min(req->page_size(), kMaxListPageSize);
    LeaseListing listing = pool->ListLeases(limit, after);
    for (const LeaseSnapshot& lease : listing.leases) ToProto(pool->name(), lease, resp->add_leases());
    if (listing.next_after != 0) resp->set_next_page_token(absl::StrCat(listing.next_after));
    resp->set_total(listing.total);
    return absl::OkStatus();
  }();
  return scope.Done(FinishCall("ListLeases", [&] { return absl::StrCat("pool=", Quote(req->pool())); }, status));
}

grpc::Status KvCacheService::MatchPrefix(cq::CallContext* ctx,
                                         const v1::MatchPrefixRequest* req,
                                         v1::MatchPrefixResponse* resp) {
  RpcScope scope = StartRpc(kRpcMatchPrefix);
  const absl::Status status = [&]() -> absl::Status {
    MLAKV_ASSIGN_OR_RETURN(Pool * pool, Prelude(req->pool()));
    std::optional<LeaseRequest> lease;
    if (req->has_lease()) {
      MLAKV_RETURN_IF_ERROR(CheckCallAlive(ctx, "no lease was taken"));
      lease = ToLeaseRequest(req->lease());
    }
    // Views of the request's bytes: a 2,048-hash chain is not copied again.
    const std::vector<absl::string_view> hashes(req->block_hashes().begin(), req->block_hashes().end());
    MLAKV_ASSIGN_OR_RETURN(PrefixMatch match, pool->MatchPrefix(std::span<const absl::string_view>(hashes), lease));
    resp->set_matched_pages(match.matched_pages);
    resp->set_matched_tokens(match.matched_pages * static_cast<uint32_t>(pool->page_size()));
    for (int32_t page : match.kv_indices) resp->add_kv_indices(static_cast<uint32_t>(page));
    if (match.lease) ToProto(pool->name(), *match.lease, resp->mutable_lease());
    return absl::OkStatus();
  }();
  const auto detail = [&] { return absl::StrCat("pool=", Quote(req->pool()), " hashes=", req->block_hashes_size()); };
  return scope.Done(FinishCall("MatchPrefix", detail, status));
}

void KvCacheService::ForkSequence(ForkSequenceCall* call) {
  RpcScope scope = StartRpc(kRpcForkSequence);
  const v1::ForkSequenceRequest* req = &call->request();
  auto detail = [req] {
    return absl::StrCat("pool=", Quote(req->pool()), " source=", Quote(req->source()), " target=",
                        Quote(req->target()), " length=", req->length(), " hashes=", req->block_hashes_size());
  };
  absl::StatusOr<Pool*> pool = [&]() -> absl::StatusOr<Pool*> {
    MLAKV_ASSIGN_OR_RETURN(Pool * p, Prelude(req->pool()));
    MLAKV_RETURN_IF_ERROR(CheckFieldLength("source", req->source(), kMaxSequenceIdBytes));
    MLAKV_RETURN_IF_ERROR(CheckFieldLength("target", req->target(), kMaxSequenceIdBytes));
    return p;
  }();
  if (!pool.ok()) {
    call->Finish(scope.Done(FinishCall("ForkSequence", detail, pool.status())));
    return;
  }
  Pool* p = *pool;
  // A worker task (the partial last page is copied there, in order with
  // appends): on this thread at once when the worker is idle, else queued
  // there and finished from the worker.
  p->worker().RunOrPost([this, call, req, p, scope, detail]() mutable {
    cq::QueueThreads::LetAnotherPoll();  // inline, a page copy may take a while
    cq::CallContext* ctx = call->context();
    v1::ForkSequenceResponse* resp = call->response();
    const absl::Status status = [&]() -> absl::Status {
      MLAKV_RETURN_IF_ERROR(CheckCallAlive(ctx, "nothing was forked"));
      ForkRequest fork;
      fork.target = req->target();
      fork.source.id = req->source();
      if (req->has_expect_generation()) fork.source.expect_generation = req->expect_generation();
      fork.block_hashes.assign(req->block_hashes().begin(), req->block_hashes().end());
      fork.length = req->length();
      fork.pin = req->pin();
      const uint32_t max_bytes = options_.max_message_bytes;
      fork.last_check = [&](size_t pages) -> absl::Status {
        MLAKV_RETURN_IF_ERROR(CheckCallAlive(ctx, "nothing was forked"));
        const uint64_t bound =
            SequenceProtoBytesBound(req->target().size(), p->name().size(), pages, p->num_pages(), p->num_layers()) +
            32;
        if (bound > max_bytes) {
          return absl::ResourceExhaustedError(absl::StrCat("the forked sequence's page table of ", pages,
                                                           " pages would need up to ", bound,
                                                           " bytes, over the ", max_bytes,
                                                           "-byte message limit; nothing was forked. Fork fewer "
                                                           "tokens"));
        }
        return absl::OkStatus();
      };
      MLAKV_ASSIGN_OR_RETURN(ForkResult result, p->Fork(fork));
      if (result.sequence) {
        ToProto(p->name(), *result.sequence, resp->mutable_sequence());
        resp->mutable_sequence()->set_server_id(options_.server_id);
      }
      resp->set_pages_shared(result.pages_shared);
      resp->set_pages_copied(result.pages_copied);
      return absl::OkStatus();
    }();
    call->Finish(scope.Done(FinishCall("ForkSequence", detail, status)));
  });
}

}  // namespace mlakv::server
