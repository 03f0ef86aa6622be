#include "server/kv_cache_service.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "kernels/dequantize.h"
#include "kernels/nvfp4_format.h"
#include "server/grpc_status.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {
namespace {

using format::kCkvDim;
using format::kCkvPackedBytes;
using format::kCkvSfBytes;
using format::kKpeBytes;
using format::kKpeDim;

constexpr uint32_t kDefaultListPageSize = 100;
constexpr uint32_t kMaxListPageSize = 1000;
constexpr uint64_t kTargetReadMessageBytes = 4 << 20;

absl::Status Draining() {
  return absl::UnavailableError("server is shutting down and accepts no new calls; retry on another replica");
}

// One line per request at debug, one per error at warn.
void LogCall(const char* method, const std::string& detail, const absl::Status& status) {
  if (status.ok()) {
    spdlog::debug("{} {}: OK", method, detail);
  } else {
    spdlog::warn("{} {}: {} {}", method, detail, absl::StatusCodeToString(status.code()), std::string(status.message()));
  }
}

grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* ctx, const char* method, const std::string& detail,
                                      const absl::Status& status) {
  LogCall(method, detail, status);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// UNSPECIFIED -> nullopt (refused by Pool::Stage when rows come); unknown values -> error.
absl::StatusOr<std::optional<DType>> ToDType(v1::RowDType dtype) {
  switch (dtype) {
    case v1::ROW_DTYPE_UNSPECIFIED: return std::optional<DType>();
    case v1::ROW_DTYPE_FLOAT16: return std::optional<DType>(DType::kFloat16);
    case v1::ROW_DTYPE_BFLOAT16: return std::optional<DType>(DType::kBFloat16);
    default:
      return absl::InvalidArgumentError(absl::StrCat("dtype ", static_cast<int>(dtype),
                                                     " is not a RowDType; use ROW_DTYPE_FLOAT16 or ROW_DTYPE_BFLOAT16"));
  }
}

// The rows of one sequence as Pool::Stage takes them: LayerRows' bytes, or
// the rows their RegionRefs name (resolved by `regions`; `hold` keeps them
// valid while the append is in flight).
absl::StatusOr<SequenceRowsIn> ToRows(const std::string& sequence, uint32_t start, uint32_t row_count,
                                      const google::protobuf::RepeatedPtrField<v1::LayerRows>& layers,
                                      uint32_t reserve_tokens, const RegionRegistry& regions, const Pool& pool,
                                      RegionHold* hold) {
  SequenceRowsIn r;
  r.start = start;
  r.row_count = row_count;
  r.reserve_tokens = reserve_tokens;
  for (const v1::LayerRows& lr : layers) {
    LayerRowsIn in;
    absl::Status s = regions.ResolveRows(absl::StrCat("sequence '", sequence, "' layer ", lr.layer()), lr, row_count,
                                         pool.device(), &in, hold);
    if (!s.ok()) return s;
    r.layers.push_back(in);
  }
  return r;
}

void ToProto(const PoolSnapshot& p, v1::Pool* out) {
  out->set_name(p.name);
  out->set_device(p.device);
  out->set_format(v1::CACHE_FORMAT_NVFP4_MLA);
  out->set_num_layers(p.num_layers);
  out->set_page_size(p.page_size);
  out->set_pages_total(p.pages_total);
  out->set_pages_free(p.pages_free);
  out->set_pages_used(p.pages_used);
  out->set_sequences(p.sequences);
  out->set_bytes_per_token_per_layer(kCkvPackedBytes + kCkvSfBytes + kKpeBytes);
  out->set_cache_bytes(p.cache_bytes);
  out->set_ckv_dim(kCkvDim);
  out->set_kpe_dim(kKpeDim);
  for (size_t l = 0; l < p.layers.size(); ++l) {
    v1::LayerScales* ls = out->add_layers();
    ls->set_layer(static_cast<uint32_t>(l));
    ls->set_set(p.layers[l].scales_set);
    ls->set_ckv_scale(p.layers[l].scales_set ? p.layers[l].ckv_scale : 0.0f);
    ls->set_kpe_scale(p.layers[l].scales_set ? p.layers[l].kpe_scale : 0.0f);
    ls->set_tokens(p.layers[l].tokens);
  }
}

void ToProto(const std::string& pool, const SequenceSnapshot& s, v1::Sequence* out) {
  out->set_pool(pool);
  out->set_id(s.id);
  out->set_length(s.length);
  for (int32_t page : s.kv_indices) out->add_kv_indices(static_cast<uint32_t>(page));
  out->set_last_page_len(s.last_page_len);
  for (uint32_t len : s.layer_lengths) out->add_layer_lengths(len);
  out->set_page_size(s.page_size);
  out->set_capacity_tokens(s.capacity_tokens);
}

}  // namespace

KvCacheService::KvCacheService(Options options) : options_(std::move(options)) {}

absl::StatusOr<Pool*> KvCacheService::FindPool(const std::string& name) const {
  const std::string& want = name.empty() ? options_.default_pool : name;
  for (Pool* pool : options_.pools) {
    if (pool->name() == want) return pool;
  }
  std::vector<std::string> names;
  for (Pool* pool : options_.pools) names.push_back(pool->name());
  return absl::NotFoundError(absl::StrCat("pool '", want, "' not found; this server has: ", absl::StrJoin(names, ", ")));
}

// ---- unary queries -------------------------------------------------------------

grpc::ServerUnaryReactor* KvCacheService::ListPools(grpc::CallbackServerContext* ctx, const v1::ListPoolsRequest*,
                                                    v1::ListPoolsResponse* resp) {
  if (draining()) return FinishUnary(ctx, "ListPools", "", Draining());
  std::vector<Pool*> pools = options_.pools;
  std::sort(pools.begin(), pools.end(), [](Pool* a, Pool* b) { return a->name() < b->name(); });
  for (Pool* pool : pools) ToProto(pool->Snapshot(), resp->add_pools());
  return FinishUnary(ctx, "ListPools", "", absl::OkStatus());
}

grpc::ServerUnaryReactor* KvCacheService::GetPool(grpc::CallbackServerContext* ctx, const v1::GetPoolRequest* req,
                                                  v1::Pool* resp) {
  const std::string detail = absl::StrCat("pool='", req->pool(), "'");
  if (draining()) return FinishUnary(ctx, "GetPool", detail, Draining());
  absl::StatusOr<Pool*> pool = FindPool(req->pool());
  if (pool.ok()) ToProto((*pool)->Snapshot(), resp);
  return FinishUnary(ctx, "GetPool", detail, pool.status());
}

grpc::ServerUnaryReactor* KvCacheService::GetSequence(grpc::CallbackServerContext* ctx,
                                                      const v1::GetSequenceRequest* req, v1::Sequence* resp) {
  const std::string detail = absl::StrCat("pool='", req->pool(), "' sequence='", req->sequence(), "'");
  if (draining()) return FinishUnary(ctx, "GetSequence", detail, Draining());
  absl::Status status = [&]() -> absl::Status {
    absl::StatusOr<Pool*> pool = FindPool(req->pool());
    if (!pool.ok()) return pool.status();
    absl::StatusOr<SequenceSnapshot> seq = (*pool)->GetSequence(req->sequence());
    if (!seq.ok()) return seq.status();
    ToProto((*pool)->name(), *seq, resp);
    return absl::OkStatus();
  }();
  return FinishUnary(ctx, "GetSequence", detail, status);
}

grpc::ServerUnaryReactor* KvCacheService::ListSequences(grpc::CallbackServerContext* ctx,
                                                        const v1::ListSequencesRequest* req,
                                                        v1::ListSequencesResponse* resp) {
  const std::string detail = absl::StrCat("pool='", req->pool(), "' page_token='", req->page_token(), "'");
  if (draining()) return FinishUnary(ctx, "ListSequences", detail, Draining());
  absl::Status status = [&]() -> absl::Status {
    absl::StatusOr<Pool*> pool = FindPool(req->pool());
    if (!pool.ok()) return pool.status();
    const uint32_t limit =
        req->page_size() == 0 ? kDefaultListPageSize : std::min(req->page_size(), kMaxListPageSize);
    SequenceListing listing = (*pool)->ListSequences(limit, req->page_token());
    for (const SequenceListing::Entry& e : listing.sequences) {
      v1::SequenceSummary* s = resp->add_sequences();
      s->set_id(e.id);
      s->set_length(e.length);
      s->set_pages(e.pages);
    }
    resp->set_next_page_token(listing.next_page_token);
    resp->set_total(listing.total);
    return absl::OkStatus();
  }();
  return FinishUnary(ctx, "ListSequences", detail, status);
}

grpc::ServerUnaryReactor* KvCacheService::GetPage(grpc::CallbackServerContext* ctx, const v1::GetPageRequest* req,
                                                  v1::Page* resp) {
  const std::string detail = absl::StrCat("pool='", req->pool(), "' page=", req->page());
  if (draining()) return FinishUnary(ctx, "GetPage", detail, Draining());
  absl::Status status = [&]() -> absl::Status {
    absl::StatusOr<Pool*> pool = FindPool(req->pool());
    if (!pool.ok()) return pool.status();
    absl::StatusOr<PageSnapshot> page = (*pool)->GetPage(req->page());
    if (!page.ok()) return page.status();
    resp->set_page(static_cast<uint32_t>(page->page));
    resp->set_used(page->used);
    resp->set_sequence(page->sequence);
    resp->set_page_index(page->page_index);
    resp->set_first_position(page->first_position);
    for (size_t l = 0; l < page->filled_per_layer.size(); ++l) {
      resp->add_filled_per_layer(page->filled_per_layer[l]);
      if (page->filled_per_layer[l] > 0) resp->add_layers_written(static_cast<uint32_t>(l));
    }
    return absl::OkStatus();
  }();
  return FinishUnary(ctx, "GetPage", detail, status);
}

grpc::ServerUnaryReactor* KvCacheService::FreeSequence(grpc::CallbackServerContext* ctx,
                                                       const v1::FreeSequenceRequest* req,
                                                       v1::FreeSequenceResponse* resp) {
  const std::string detail = absl::StrCat("pool='", req->pool(), "' sequence='", req->sequence(), "'");
  if (draining()) return FinishUnary(ctx, "FreeSequence", detail, Draining());
  absl::Status status = [&]() -> absl::Status {
    absl::StatusOr<Pool*> pool = FindPool(req->pool());
    if (!pool.ok()) return pool.status();
    absl::StatusOr<uint32_t> freed = (*pool)->FreeSequence(req->sequence());
    if (!freed.ok()) return freed.status();
    resp->set_pages_freed(*freed);
    return absl::OkStatus();
  }();
  return FinishUnary(ctx, "FreeSequence", detail, status);
}

grpc::ServerUnaryReactor* KvCacheService::TruncateSequence(grpc::CallbackServerContext* ctx,
                                                           const v1::TruncateSequenceRequest* req,
                                                           v1::Sequence* resp) {
  const std::string detail =
      absl::StrCat("pool='", req->pool(), "' sequence='", req->sequence(), "' length=", req->length());
  if (draining()) return FinishUnary(ctx, "TruncateSequence", detail, Draining());
  absl::Status status = [&]() -> absl::Status {
    absl::StatusOr<Pool*> pool = FindPool(req->pool());
    if (!pool.ok()) return pool.status();
    absl::StatusOr<SequenceSnapshot> seq = (*pool)->TruncateSequence(req->sequence(), req->length());
    if (!seq.ok()) return seq.status();
    ToProto((*pool)->name(), *seq, resp);
    return absl::OkStatus();
  }();
  return FinishUnary(ctx, "TruncateSequence", detail, status);
}

// ---- AppendBatch ------------------------------------------------------------------

grpc::ServerUnaryReactor* KvCacheService::AppendBatch(grpc::CallbackServerContext* ctx,
                                                      const v1::AppendBatchRequest* req,
                                                      v1::AppendBatchResponse* resp) {
  const std::string detail = absl::StrCat("pool='", req->pool(), "' sequences=", req->sequences_size());
  if (draining()) return FinishUnary(ctx, "AppendBatch", detail, Draining());
  absl::StatusOr<Pool*> pool = FindPool(req->pool());
  if (!pool.ok()) return FinishUnary(ctx, "AppendBatch", detail, pool.status());
  absl::StatusOr<std::optional<DType>> dtype = ToDType(req->dtype());
  if (!dtype.ok()) return FinishUnary(ctx, "AppendBatch", detail, dtype.status());
  absl::flat_hash_set<std::string_view> ids;
  for (const v1::SequenceRows& s : req->sequences()) {
    if (!ids.insert(s.sequence()).second) {
      return FinishUnary(ctx, "AppendBatch", detail,
                         absl::InvalidArgumentError(absl::StrCat("sequence '", s.sequence(),
                                                                 "' appears twice in one AppendBatch; merge its rows")));
    }
  }
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  Pool* p = *pool;
  const RegionRegistry* regions = options_.regions;
  appends_in_flight_.fetch_add(1);
  p->worker().Post([this, p, req, resp, reactor, detail, dtype = *dtype, regions] {
    std::vector<std::unique_ptr<AppendTransaction>> txns;
    std::vector<AppendTransaction*> raw_txns;
    std::vector<SequenceRowsIn> rows;
    RegionHold hold;  // regions named by the rows, until the call ends
    absl::Status status;
    for (const v1::SequenceRows& s : req->sequences()) {
      absl::StatusOr<std::unique_ptr<AppendTransaction>> txn = p->BeginAppend(s.sequence());
      if (!txn.ok()) {
        status = txn.status();
        break;
      }
      raw_txns.push_back(txn->get());
      txns.push_back(std::move(*txn));
      absl::StatusOr<SequenceRowsIn> r = ToRows(s.sequence(), s.start(), s.row_count(), s.layers(), 0, *regions, *p,
                                                &hold);
      if (!r.ok()) {
        status = r.status();
        break;
      }
      rows.push_back(std::move(*r));
    }
    if (status.ok()) {
      std::vector<const SequenceRowsIn*> row_ptrs;
      for (const SequenceRowsIn& r : rows) row_ptrs.push_back(&r);
      status = p->Stage(raw_txns, row_ptrs, dtype);
    }
    if (!status.ok()) {
      for (auto& txn : txns) p->Abort(*txn);
    } else {
      uint64_t rows_written = 0;
      uint32_t pages = 0;
      for (auto& txn : txns) {
        rows_written += txn->rows_written();
        pages += txn->pages_allocated();
        ToProto(p->name(), p->Commit(*txn), resp->add_sequences());
      }
      resp->set_rows_written(rows_written);
      resp->set_pages_allocated(pages);
    }
    LogCall("AppendBatch", detail, status);
    appends_in_flight_.fetch_sub(1);
    reactor->Finish(ToGrpcStatus(status));
  });
  return reactor;
}

// ---- Append (client stream) ----------------------------------------------------------

// One Append stream. Messages are validated, staged and written on the
// pool's worker, in order. Two message buffers: while the worker processes
// message k, message k+1 is already being received into the other buffer
// (and the read of k+2 starts as soon as k's buffer is free), so on a long
// stream the network, protobuf parsing and the worker overlap. The end of the
// stream commits (or, after a cancel, aborts) on the worker too.
//
// Lifetime: Finish is called exactly once, from the worker, and only when no
// task of this reactor is queued there; gRPC may still complete a read in
// flight (OnReadDone(false), which then does nothing) and calls OnDone, which
// deletes the reactor, after that.
class KvCacheService::AppendReactor : public grpc::ServerReadReactor<v1::AppendRequest> {
 public:
  AppendReactor(KvCacheService* service, grpc::CallbackServerContext* ctx, v1::AppendResponse* resp)
      : service_(service), ctx_(ctx), resp_(resp) {
    if (service_->draining()) {
      Done(Draining());
      return;
    }
    service_->appends_in_flight_.fetch_add(1);
    counted_ = true;
    StartRead(&buffers_[0]);
  }

  void OnReadDone(bool ok) override {
    int next_read = -1;
    std::optional<absl::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      const int got = reading_;
      reading_ = -1;
      if (finishing_) return;  // an earlier message failed; the stream is being finished
      if (!ok) {
        // Half-close (commit) or cancellation (abort): decided on the worker,
        // after every message queued before it.
        if (pool_ == nullptr) {
          finishing_ = true;
          finish_status_ = ctx_->IsCancelled() ? absl::CancelledError("Append cancelled before its first message")
                                               : absl::InvalidArgumentError("Append stream carried no message");
        } else {
          ++queued_;
          pool_->worker().Post([this] { Complete(); });
        }
      } else {
        if (pool_ == nullptr) {
          absl::StatusOr<Pool*> pool = service_->FindPool(buffers_[got].pool());
          if (!pool.ok()) {
            finishing_ = true;
            finish_status_ = pool.status();
          } else {
            pool_ = *pool;
            pool_field_ = buffers_[got].pool();
            sequence_ = buffers_[got].sequence();
          }
        }
        if (!finishing_) {
          busy_[got] = true;
          ++queued_;
          pool_->worker().Post([this, got] { Process(got); });
          next_read = TakeFreeBufferLocked();
        }
      }
      finish = TakeFinishLocked();
    }
    if (finish) Done(*finish);
    if (next_read >= 0) StartReadInto(next_read);
  }

  void OnCancel() override { cancelled_.store(true); }
  void OnDone() override { delete this; }

 private:
  // The buffer to read the next message into, marked as being read; -1 when
  // both hold messages not yet processed (the worker starts the read when it
  // frees one). Never called with a read in flight.
  int TakeFreeBufferLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (int b = 0; b < 2; ++b) {
      if (!busy_[b]) {
        reading_ = b;
        ++starting_reads_;  // Finish waits until StartRead has been called
        return b;
      }
    }
    read_wanted_ = true;
    return -1;
  }

  // Called without mu_ (the read may complete, and OnReadDone run, before
  // StartRead returns).
  void StartReadInto(int b) {
    StartRead(&buffers_[b]);
    std::optional<absl::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      --starting_reads_;
      finish = TakeFinishLocked();
    }
    if (finish) Done(*finish);
  }

  // On the worker: message in buffers_[b].
  void Process(int b) {
    bool skip;
    {
      absl::MutexLock lock(&mu_);
      skip = finishing_;
    }
    absl::Status status = skip ? absl::OkStatus() : ProcessMessage(buffers_[b]);
    int next_read = -1;
    std::optional<absl::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      busy_[b] = false;
      --queued_;
      if (!status.ok()) {
        finishing_ = true;
        finish_status_ = status;
      }
      if (!finishing_ && read_wanted_) {
        read_wanted_ = false;
        next_read = TakeFreeBufferLocked();
      }
      finish = TakeFinishLocked();
    }
    if (finish) Done(*finish);
    if (next_read >= 0) StartReadInto(next_read);
  }

  absl::Status ProcessMessage(const v1::AppendRequest& req) {
    ++messages_;
    absl::Status status = [&]() -> absl::Status {
      if (messages_ > 1) {
        if (!req.pool().empty() && req.pool() != pool_field_) {
          return absl::InvalidArgumentError(absl::StrCat("message ", messages_, " names pool '", req.pool(),
                                                         "' but the stream's first message named '", pool_field_,
                                                         "'; leave it empty after the first message"));
        }
        if (!req.sequence().empty() && req.sequence() != sequence_) {
          return absl::InvalidArgumentError(absl::StrCat("message ", messages_, " names sequence '", req.sequence(),
                                                         "' but the stream is for '", sequence_,
                                                         "'; one Append stream writes one sequence"));
        }
        if (req.reserve_tokens() != 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "message ", messages_, " sets reserve_tokens; only the first message of a stream may reserve"));
        }
      }
      absl::StatusOr<std::optional<DType>> dtype = ToDType(req.dtype());
      if (!dtype.ok()) return dtype.status();
      if (txn_ == nullptr) {
        absl::StatusOr<std::unique_ptr<AppendTransaction>> txn = pool_->BeginAppend(sequence_);
        if (!txn.ok()) return txn.status();
        txn_ = std::move(*txn);
      }
      absl::StatusOr<SequenceRowsIn> rows = ToRows(sequence_, req.start(), req.row_count(), req.layers(),
                                                   req.reserve_tokens(), *service_->options_.regions, *pool_,
                                                   &regions_held_);
      if (!rows.ok()) return rows.status();
      AppendTransaction* txn = txn_.get();
      const SequenceRowsIn* rows_ptr = &*rows;
      absl::Status staged = pool_->Stage({&txn, 1}, {&rows_ptr, 1}, *dtype);
      // The rows are in the cache now: packed copies of strided region rows
      // go (the regions themselves stay held until the stream ends).
      regions_held_.gathered.clear();
      return staged;
    }();
    if (status.ok()) return status;
    if (txn_ != nullptr) pool_->Abort(*txn_);
    return absl::Status(status.code(),
                        absl::StrCat(status.message(), messages_ > 1 ? absl::StrCat(" (message ", messages_,
                                                                                    " of the stream; the whole "
                                                                                    "append was rolled back)")
                                                                     : ""));
  }

  // On the worker: the stream ended (every message before it is processed).
  void Complete() {
    bool skip;
    {
      absl::MutexLock lock(&mu_);
      skip = finishing_;
    }
    absl::Status status = skip ? absl::OkStatus() : CommitOrAbort();
    std::optional<absl::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      --queued_;
      if (!skip) {
        finishing_ = true;
        finish_status_ = status;
      }
      finish = TakeFinishLocked();
    }
    if (finish) Done(*finish);
  }

  absl::Status CommitOrAbort() {
    if (cancelled_.load() || ctx_->IsCancelled()) {
      if (txn_ != nullptr) pool_->Abort(*txn_);
      return absl::CancelledError("Append cancelled by the client; nothing was written");
    }
    if (txn_ == nullptr) return absl::InternalError("Append ended without a transaction");  // a message came first
    const uint64_t rows = txn_->rows_written();
    const uint32_t pages = txn_->pages_allocated();
    ToProto(pool_->name(), pool_->Commit(*txn_), resp_->mutable_sequence());
    resp_->set_rows_written(rows);
    resp_->set_pages_allocated(pages);
    return absl::OkStatus();
  }

  // The status to finish with, once: when the stream is finishing, no task of
  // this reactor is left on the worker and no StartRead is about to be made.
  std::optional<absl::Status> TakeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!finishing_ || queued_ > 0 || starting_reads_ > 0 || finish_taken_) return std::nullopt;
    finish_taken_ = true;
    return finish_status_;
  }

  void Done(const absl::Status& status) {
    LogCall("Append", absl::StrCat("pool='", pool_ ? pool_->name() : pool_field_, "' sequence='", sequence_,
                                   "' messages=", messages_, " rows=", txn_ ? txn_->rows_written() : 0),
            status);
    if (counted_) service_->appends_in_flight_.fetch_sub(1);  // before Finish: OnDone may follow at once
    Finish(ToGrpcStatus(status));
  }

  KvCacheService* service_;
  grpc::CallbackServerContext* ctx_;
  v1::AppendResponse* resp_;
  bool counted_ = false;  // in appends_in_flight_ (not when refused while draining)
  v1::AppendRequest buffers_[2];
  absl::Mutex mu_;
  int reading_ ABSL_GUARDED_BY(mu_) = 0;         // buffer a read is in flight into, -1: none
  bool busy_[2] ABSL_GUARDED_BY(mu_) = {false, false};  // holds a message queued on / being processed by the worker
  bool read_wanted_ ABSL_GUARDED_BY(mu_) = false;  // a read waits for a free buffer
  int queued_ ABSL_GUARDED_BY(mu_) = 0;           // tasks of this reactor on the worker
  int starting_reads_ ABSL_GUARDED_BY(mu_) = 0;   // reads decided on, StartRead not yet returned
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_taken_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status finish_status_ ABSL_GUARDED_BY(mu_);
  // Set by the first OnReadDone before any task is posted; read-only after.
  Pool* pool_ = nullptr;
  std::string pool_field_;
  std::string sequence_;
  // Worker-only state.
  std::unique_ptr<AppendTransaction> txn_;
  // Regions the stream's messages named: held until the stream ends, so an
  // UnregisterRegion meanwhile never unmaps memory this append reads.
  RegionHold regions_held_;
  int messages_ = 0;
  std::atomic<bool> cancelled_{false};
};

grpc::ServerReadReactor<v1::AppendRequest>* KvCacheService::Append(grpc::CallbackServerContext* ctx,
                                                                   v1::AppendResponse* resp) {
  return new AppendReactor(this, ctx, resp);
}

// ---- ReadSequence (server stream) ------------------------------------------------------

// Chunks are produced one at a time on the pool's worker (copy out of the
// cache, dequantize if asked) and written from there; the next chunk is
// produced when the previous write has completed.
class KvCacheService::ReadReactor : public grpc::ServerWriteReactor<v1::ReadSequenceResponse> {
 public:
  ReadReactor(KvCacheService* service, grpc::CallbackServerContext* ctx, const v1::ReadSequenceRequest* req)
      : sequence_(req->sequence()), detail_(absl::StrCat("pool='", req->pool(), "' sequence='", req->sequence(), "'")) {
    (void)ctx;
    absl::Status status = [&]() -> absl::Status {
      if (service->draining()) return Draining();
      absl::StatusOr<Pool*> pool = service->FindPool(req->pool());
      if (!pool.ok()) return pool.status();
      pool_ = *pool;
      switch (req->format()) {
        case v1::READ_FORMAT_UNSPECIFIED:
        case v1::READ_FORMAT_RAW: dequantize_ = false; break;
        case v1::READ_FORMAT_DEQUANTIZED: dequantize_ = true; break;
        default:
          return absl::InvalidArgumentError(absl::StrCat("format ", static_cast<int>(req->format()),
                                                         " is not a ReadFormat; use READ_FORMAT_RAW or "
                                                         "READ_FORMAT_DEQUANTIZED"));
      }
      uint32_t count = req->count();
      std::vector<uint32_t> layers(req->layers().begin(), req->layers().end());
      absl::StatusOr<std::vector<int32_t>> planned = pool_->PlanRead(sequence_, layers, req->start(), &count);
      if (!planned.ok()) return planned.status();
      const uint64_t per_token = dequantize_ ? (kCkvDim + kKpeDim) * sizeof(float)
                                             : kCkvPackedBytes + kCkvSfBytes + kKpeBytes;
      uint64_t per_message = req->tokens_per_message() != 0 ? req->tokens_per_message()
                                                            : std::max<uint64_t>(1, kTargetReadMessageBytes / per_token);
      const uint64_t cap = std::max<uint64_t>(1, (service->options_.max_message_bytes - 4096) / per_token);
      per_message_ = static_cast<uint32_t>(std::min(per_message, cap));
      layers_ = std::move(*planned);
      start_ = req->start();
      count_ = count;
      return absl::OkStatus();
    }();
    if (!status.ok() || count_ == 0 || layers_.empty()) {
      Done(status);
      return;
    }
    Next();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Done(absl::CancelledError("the client stopped reading"));
      return;
    }
    if (layer_index_ < layers_.size()) {
      Next();
    } else {
      Done(absl::OkStatus());
    }
  }

  void OnDone() override { delete this; }

 private:
  struct Chunk {
    int32_t layer;
    uint32_t start;
    uint32_t count;
  };

  // The next chunk: up to per_message_ tokens of the current layer; then the
  // next layer. Advances the cursor.
  Chunk TakeChunk() {
    const uint32_t n = std::min(per_message_, count_ - offset_);
    Chunk c{layers_[layer_index_], start_ + offset_, n};
    offset_ += n;
    if (offset_ == count_) {
      offset_ = 0;
      ++layer_index_;
    }
    ++sent_;
    return c;
  }

  void Next() {
    pool_->worker().Post([this] {
      absl::Status status = Produce(TakeChunk());
      if (!status.ok()) {
        Done(status);
        return;
      }
      StartWrite(&resp_);
    });
  }

  // On the worker.
  absl::Status Produce(const Chunk& c) {
    resp_.Clear();
    resp_.set_layer(static_cast<uint32_t>(c.layer));
    resp_.set_start(c.start);
    resp_.set_count(c.count);
    std::string* ckv = resp_.mutable_ckv_packed();
    std::string* sf = resp_.mutable_ckv_sf();
    std::string* kpe = resp_.mutable_kpe();
    ckv->resize(static_cast<size_t>(c.count) * kCkvPackedBytes);
    sf->resize(static_cast<size_t>(c.count) * kCkvSfBytes);
    kpe->resize(static_cast<size_t>(c.count) * kKpeBytes);
    LayerSnapshot layer;
    absl::Status s = pool_->ReadRows(sequence_, c.layer, c.start, c.count,
                                     {reinterpret_cast<uint8_t*>(ckv->data()), reinterpret_cast<uint8_t*>(sf->data()),
                                      reinterpret_cast<uint8_t*>(kpe->data())},
                                     &layer);
    if (!s.ok()) return s;
    resp_.set_ckv_scale(layer.ckv_scale);
    resp_.set_kpe_scale(layer.kpe_scale);
    if (dequantize_) {
      std::string* ckv_f = resp_.mutable_ckv_float();
      std::string* kpe_f = resp_.mutable_kpe_float();
      ckv_f->resize(static_cast<size_t>(c.count) * kCkvDim * sizeof(float));
      kpe_f->resize(static_cast<size_t>(c.count) * kKpeDim * sizeof(float));
      DequantizeParams p;
      p.ckv_packed = reinterpret_cast<const uint8_t*>(ckv->data());
      p.ckv_sf = reinterpret_cast<const uint8_t*>(sf->data());
      p.kpe = reinterpret_cast<const uint8_t*>(kpe->data());
      p.num_rows = c.count;
      p.out_ckv = reinterpret_cast<float*>(ckv_f->data());
      p.out_kpe = reinterpret_cast<float*>(kpe_f->data());
      p.ckv_scale = layer.ckv_scale;
      p.kpe_scale = layer.kpe_scale;
      DequantizeHost(p);  // little-endian float32 on every supported host
      resp_.clear_ckv_packed();
      resp_.clear_ckv_sf();
      resp_.clear_kpe();
    }
    return absl::OkStatus();
  }

  void Done(const absl::Status& status) {
    LogCall("ReadSequence", absl::StrCat(detail_, " layers=", layers_.size(), " start=", start_, " count=", count_,
                                         " messages=", sent_), status);
    Finish(ToGrpcStatus(status));
  }

  std::string sequence_;
  std::string detail_;
  Pool* pool_ = nullptr;
  bool dequantize_ = false;
  std::vector<int32_t> layers_;  // layers to read, in order
  uint32_t start_ = 0;           // first token
  uint32_t count_ = 0;           // tokens per layer
  uint32_t per_message_ = 1;     // tokens per response message
  size_t layer_index_ = 0;       // cursor: layer being read
  uint32_t offset_ = 0;          // cursor: tokens of it already sent
  uint64_t sent_ = 0;            // messages produced
  v1::ReadSequenceResponse resp_;
};

grpc::ServerWriteReactor<v1::ReadSequenceResponse>* KvCacheService::ReadSequence(
    grpc::CallbackServerContext* ctx, const v1::ReadSequenceRequest* req) {
  return new ReadReactor(this, ctx, req);
}

// ---- regions (docs/server.md "Regions") ---------------------------------------------

grpc::ServerUnaryReactor* KvCacheService::RegisterShmRegion(grpc::CallbackServerContext* ctx,
                                                            const v1::RegisterShmRegionRequest* req,
                                                            v1::Region* resp) {
  const std::string detail = absl::StrCat("name='", req->name(), "' shm_name='", req->shm_name(), "' offset=",
                                          req->offset(), " byte_size=", req->byte_size());
  if (draining()) return FinishUnary(ctx, "RegisterShmRegion", detail, Draining());
  absl::StatusOr<v1::Region> region = options_.regions->RegisterShm(*req);
  if (region.ok()) *resp = std::move(*region);
  return FinishUnary(ctx, "RegisterShmRegion", detail, region.status());
}

grpc::ServerUnaryReactor* KvCacheService::RegisterCudaRegion(grpc::CallbackServerContext* ctx,
                                                             const v1::RegisterCudaRegionRequest* req,
                                                             v1::Region* resp) {
  const std::string detail = absl::StrCat("name='", req->name(), "' device_id=", req->device_id(),
                                          " byte_size=", req->byte_size());
  if (draining()) return FinishUnary(ctx, "RegisterCudaRegion", detail, Draining());
  absl::StatusOr<v1::Region> region = options_.regions->RegisterCuda(*req);
  if (region.ok()) *resp = std::move(*region);
  return FinishUnary(ctx, "RegisterCudaRegion", detail, region.status());
}

grpc::ServerUnaryReactor* KvCacheService::UnregisterRegion(grpc::CallbackServerContext* ctx,
                                                           const v1::UnregisterRegionRequest* req,
                                                           v1::UnregisterRegionResponse* resp) {
  const std::string detail = absl::StrCat("name='", req->name(), "'");
  if (draining()) return FinishUnary(ctx, "UnregisterRegion", detail, Draining());
  absl::StatusOr<uint32_t> holders = options_.regions->Unregister(req->name());
  if (holders.ok()) resp->set_appends_in_flight(*holders);
  return FinishUnary(ctx, "UnregisterRegion", detail, holders.status());
}

grpc::ServerUnaryReactor* KvCacheService::ListRegions(grpc::CallbackServerContext* ctx,
                                                      const v1::ListRegionsRequest*, v1::ListRegionsResponse* resp) {
  if (draining()) return FinishUnary(ctx, "ListRegions", "", Draining());
  absl::StatusOr<std::vector<v1::Region>> regions = options_.regions->List();
  if (regions.ok()) {
    for (v1::Region& r : *regions) *resp->add_regions() = std::move(r);
  }
  return FinishUnary(ctx, "ListRegions", "", regions.status());
}

grpc::ServerUnaryReactor* KvCacheService::ExportPool(grpc::CallbackServerContext* ctx,
                                                     const v1::ExportPoolRequest* req, v1::ExportPoolResponse* resp) {
  const std::string detail = absl::StrCat("pool='", req->pool(), "'");
  if (draining()) return FinishUnary(ctx, "ExportPool", detail, Draining());
  absl::Status status = [&]() -> absl::Status {
    if (absl::Status s = options_.regions->CheckAllowed("ExportPool"); !s.ok()) return s;
    absl::StatusOr<Pool*> pool = FindPool(req->pool());
    if (!pool.ok()) return pool.status();
    absl::StatusOr<std::vector<CacheBackend::LayerHandles>> handles = (*pool)->ExportHandles();
    if (!handles.ok()) {
      return absl::Status(handles.status().code(),
                          absl::StrCat("pool '", (*pool)->name(), "': ", handles.status().message()));
    }
    const PoolSnapshot snap = (*pool)->Snapshot();
    const uint64_t entries = static_cast<uint64_t>(snap.pages_total) * snap.page_size;
    resp->set_pool(snap.name);
    resp->set_device_id(std::stoi(snap.device.substr(5)));  // "cuda:N": only cuda pools export
    resp->set_format(v1::CACHE_FORMAT_NVFP4_MLA);
    resp->set_num_pages(snap.pages_total);
    resp->set_page_size(snap.page_size);
    for (size_t l = 0; l < handles->size(); ++l) {
      v1::ExportedLayer* out = resp->add_layers();
      out->set_layer(static_cast<uint32_t>(l));
      const CacheBackend::LayerHandles& h = (*handles)[l];
      for (auto [buf, handle, stride] : {std::tuple<v1::ExportedBuffer*, const std::string*, uint32_t>{
                                             out->mutable_ckv_cache(), &h.ckv, kCkvPackedBytes},
                                         {out->mutable_ckv_sf_cache(), &h.ckv_sf, kCkvSfBytes},
                                         {out->mutable_kpe_cache(), &h.kpe, kKpeBytes}}) {
        buf->set_raw_handle(*handle);
        buf->set_offset(0);
        buf->set_byte_size(entries * stride);
        buf->set_entry_stride_bytes(stride);
      }
      if (l < snap.layers.size() && snap.layers[l].scales_set) {
        out->set_ckv_scale(snap.layers[l].ckv_scale);
        out->set_kpe_scale(snap.layers[l].kpe_scale);
      }
    }
    return absl::OkStatus();
  }();
  return FinishUnary(ctx, "ExportPool", detail, status);
}

}  // namespace mlakv::server
