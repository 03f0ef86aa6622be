#include "server/rpc/kv_cache_service.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "kernels/nvfp4_format.h"
#include "server/core/atomic_append.h"
#include "server/rpc/call_support.h"
#include "server/rpc/grpc_status.h"
#include "server/rpc/proto_convert.h"

namespace mlakv::server {
namespace {

using format::kCkvPackedBytes;
using format::kCkvSfBytes;
using format::kKpeBytes;

// Bytes of one row of ckv + kpe (both dtypes have 2-byte elements).
constexpr uint64_t kRowBytes = (format::kCkvDim + format::kKpeDim) * 2;

// The watchdog looks four times per timeout, between 50 ms and 1 s apart.
absl::Duration WatchdogPeriod(absl::Duration idle_timeout) {
  return std::clamp(idle_timeout / 4, absl::Milliseconds(50), absl::Seconds(1));
}

std::string PoolDetail(const std::string& pool) { return absl::StrCat("pool=", Quote(pool)); }

std::string SequenceDetail(const std::string& pool, const std::string& sequence) {
  return absl::StrCat("pool=", Quote(pool), " sequence=", Quote(sequence));
}

// The regions an AppendBatch's references name, in order, a name repeated
// within the last two left out (a decode step names one or two regions 122
// times).
std::vector<absl::string_view> RegionNamesOf(const v1::AppendBatchRequest& req) {
  std::vector<absl::string_view> names;
  const auto add = [&names](const v1::RegionRef& ref) {
    const absl::string_view name = ref.region();
    const size_t n = names.size();
    if ((n > 0 && names[n - 1] == name) || (n > 1 && names[n - 2] == name)) return;
    names.push_back(name);
  };
  const auto add_layer = [&add](const v1::LayerRows& l) {
    if (l.has_ckv_ref()) add(l.ckv_ref());
    if (l.has_kpe_ref()) add(l.kpe_ref());
  };
  for (const v1::LayerRows& l : req.batch_layers()) add_layer(l);
  for (const v1::SequenceRows& s : req.sequences()) {
    for (const v1::LayerRows& l : s.layers()) add_layer(l);
  }
  return names;
}

// An AppendBatch writing at most this many rows x layers runs its task
// inline without passing the queue's turn on (docs/server.md "Threads"): the
// whole task -- microseconds of host work, a small quantize on the cpu or
// one small launch and its synchronize on a GPU -- costs less than waking
// another thread to poll, and the thread that took the call would otherwise
// wait for its turn again afterwards. A decode step (256 x 61) passes it on.
constexpr uint64_t kKeepTurnRowLayers = 64;

// An AppendBatch of at least this many sequences (and more rows x layers
// than kKeepTurnRowLayers) always runs on the pool's worker thread, even
// when the worker is idle and the thread that took the call could run it at
// once. Its host work walks every sequence's state (table entry, page list,
// lengths), and on one fixed thread that state stays in the core's caches
// from one step to the next; inline it runs on whichever of the queue
// threads took the call. A decode step (256 x 1 x 61) on an H100 host:
// prepare 91-101 -> 55-68 us, stage 141-155 -> 88-118, commit 54-57 ->
// 38-48, for 12-21 us more waiting for the worker; end to end -90 to -170 us
// (docs/performance.md "The decode step on the pool's worker thread").
// Fewer sequences (a prefill chunk, one row) keep running inline.
constexpr int kWorkerThreadSequences = 16;

// Rows x layers an AppendBatch asks to write (its sequences' row counts times
// the layers each names, shared or its own), counted only until it passes
// kKeepTurnRowLayers.
uint64_t RowLayersOf(const v1::AppendBatchRequest& req) {
  uint64_t total = 0;
  const uint64_t shared = static_cast<uint64_t>(req.batch_layers_size());
  for (const v1::SequenceRows& s : req.sequences()) {
    total += static_cast<uint64_t>(s.row_count()) * (shared + static_cast<uint64_t>(s.layers_size()));
    if (total > kKeepTurnRowLayers) return total;  // enough to know
  }
  return total;
}

// What ends a wait for an AppendBatch's producers' events: the call's
// deadline or the server's append_idle_timeout, whichever comes first, and
// the call's cancellation.
WaitLimits BatchWaitLimits(const cq::CallContext* ctx, absl::Duration idle_timeout) {
  absl::Time deadline = absl::Now() + idle_timeout;
  if (const auto d = ctx->deadline(); d != std::chrono::system_clock::time_point::max()) {
    deadline = std::min(deadline, absl::FromChrono(d));
  }
  return WaitLimits{.deadline = deadline, .abandoned = [ctx] { return ctx->cancelled(); }};
}

}  // namespace

std::vector<std::string> KvCacheService::SelfRecordedPaths() {
  static constexpr const char* kNames[kRpcMethods] = {
      "ListPools",        "GetPool",          "AppendBatch", "GetSequence",  "ListSequences", "GetPage",
      "FreeSequence",     "TruncateSequence", "UnregisterRegion", "ListRegions", "ExportPool", "AcquireLease",
      "RenewLease",       "ReleaseLease",     "ListLeases",  "ForkSequence", "MatchPrefix",
      "CommitAppend"};
  std::vector<std::string> out;
  for (const char* name : kNames) out.push_back(absl::StrCat("/", v1::KvCache::service_full_name(), "/", name));
  return out;
}

KvCacheService::RpcScope::RpcScope(ServerMetrics* metrics, ServerMetrics::RpcChildren* children)
    : metrics_(metrics), children_(children), start_(std::chrono::steady_clock::now()) {
  if (metrics_ != nullptr) metrics_->RpcStarted(*children_);
}

grpc::Status KvCacheService::RpcScope::Done(grpc::Status status) {
  if (metrics_ != nullptr) {
    metrics_->RpcFinished(*children_, status.error_code(),
                          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  return status;
}

KvCacheService::KvCacheService(Options options)
    : options_(std::move(options)),
      control_(std::make_unique<SerialExecutor>()),
      watchdog_(std::make_unique<StreamWatchdog>(WatchdogPeriod(options_.append_idle_timeout))) {
  // One thread per four cores, 1 to 4: each 4 MB message gives them a few
  // tens of microseconds of work (8 connections: ~2,500 messages a second).
  const unsigned transports = std::clamp(std::thread::hardware_concurrency() / 4, 1u, 4u);
  for (unsigned t = 0; t < transports; ++t) transport_.push_back(std::make_unique<SerialExecutor>());
  if (options_.metrics != nullptr) {
    const std::vector<std::string> paths = SelfRecordedPaths();
    for (int m = 0; m < kRpcMethods; ++m) rpc_children_[m] = &options_.metrics->ChildrenOf(paths[m]);
  }
}

KvCacheService::~KvCacheService() {
  watchdog_.reset();
  control_.reset();
  transport_.clear();  // runs what is still posted (an Append's Finish)
}

SerialExecutor::Load KvCacheService::TransportLoad() const {
  SerialExecutor::Load sum;
  for (const auto& t : transport_) {
    const SerialExecutor::Load one = t->load();
    sum.busy_seconds += one.busy_seconds;
    sum.pending += one.pending;
  }
  return sum;
}

SerialExecutor& KvCacheService::NextTransport() {
  return *transport_[next_transport_.fetch_add(1, std::memory_order_relaxed) % transport_.size()];
}

absl::StatusOr<Pool*> KvCacheService::FindPool(const std::string& name) const {
  const std::string& want = name.empty() ? options_.default_pool : name;
  for (Pool* pool : options_.pools) {
    if (pool->name() == want) return pool;
  }
  std::vector<std::string> names;
  for (Pool* pool : options_.pools) names.push_back(Quote(pool->name()));
  return absl::NotFoundError(absl::StrCat("pool ", Quote(want), " not found; this server has: ", absl::StrJoin(names, ", ")));
}

absl::StatusOr<Pool*> KvCacheService::Prelude(const std::string& pool) const {
  if (draining()) return DrainingError();
  MLAKV_RETURN_IF_ERROR(CheckFieldLength("pool", pool));
  return FindPool(pool);
}

void KvCacheService::AppendEnded(const AppendOutcome& outcome) {
  if (options_.on_append) options_.on_append(outcome);
  appends_in_flight_.fetch_sub(1);
}

// ---- unary queries -------------------------------------------------------------

grpc::Status KvCacheService::ListPools(cq::CallContext*, const v1::ListPoolsRequest*, v1::ListPoolsResponse* resp) {
  RpcScope scope = StartRpc(kRpcListPools);
  if (draining()) return scope.Done(FinishCall("ListPools", [&] { return std::string(""); }, DrainingError()));
  std::vector<Pool*> pools = options_.pools;
  std::sort(pools.begin(), pools.end(), [](Pool* a, Pool* b) { return a->name() < b->name(); });
  for (Pool* pool : pools) {
    v1::Pool* out = resp->add_pools();
    ToProto(pool->Snapshot(), out);
    out->set_server_id(options_.server_id);
  }
  return scope.Done(FinishCall("ListPools", [&] { return std::string(""); }, absl::OkStatus()));
}

grpc::Status KvCacheService::GetPool(cq::CallContext*, const v1::GetPoolRequest* req, v1::Pool* resp) {
  RpcScope scope = StartRpc(kRpcGetPool);
  absl::StatusOr<Pool*> pool = Prelude(req->pool());
  if (pool.ok()) {
    ToProto((*pool)->Snapshot(), resp);
    resp->set_server_id(options_.server_id);
  }
  return scope.Done(FinishCall("GetPool", [&] { return PoolDetail(req->pool()); }, pool.status()));
}

grpc::Status KvCacheService::GetSequence(cq::CallContext* ctx,
                                         const v1::GetSequenceRequest* req, v1::Sequence* resp) {
  RpcScope scope = StartRpc(kRpcGetSequence);
  const absl::Status status = [&]() -> absl::Status {
    MLAKV_ASSIGN_OR_RETURN(Pool * pool, Prelude(req->pool()));
    MLAKV_RETURN_IF_ERROR(CheckFieldLength("sequence", req->sequence(), kMaxSequenceIdBytes));
    std::optional<LeaseRequest> lease;
    if (req->has_lease()) {
      MLAKV_RETURN_IF_ERROR(CheckCallAlive(ctx, "no lease was taken"));
      lease = ToLeaseRequest(req->lease());
    }
    MLAKV_ASSIGN_OR_RETURN(SequenceSnapshot seq, pool->GetSequence(RefOf(*req), lease));
    ToProto(pool->name(), seq, resp);
    resp->set_server_id(options_.server_id);
    return absl::OkStatus();
  }();
  return scope.Done(FinishCall("GetSequence", [&] { return SequenceDetail(req->pool(), req->sequence()); }, status));
}

grpc::Status KvCacheService::ListSequences(cq::CallContext*,
                                           const v1::ListSequencesRequest* req,
                                           v1::ListSequencesResponse* resp) {
  RpcScope scope = StartRpc(kRpcListSequences);
  const absl::Status status = [&]() -> absl::Status {
    MLAKV_ASSIGN_OR_RETURN(Pool * pool, Prelude(req->pool()));
    MLAKV_RETURN_IF_ERROR(CheckFieldLength("page_token", req->page_token(), kMaxSequenceIdBytes));
    const uint32_t limit =
        req->page_size() == 0 ? kDefaultListPageSize : std::min(req->page_size(), kMaxListPageSize);
    SequenceListing listing = pool->ListSequences(limit, req->page_token());
    for (const SequenceListing::Entry& e : listing.sequences) {
      v1::SequenceSummary* s = resp->add_sequences();
      s->set_id(e.id);
      s->set_length(e.length);
      s->set_pages(e.pages);
    }
    resp->set_next_page_token(listing.next_page_token);
    resp->set_total(listing.total);
    resp->set_server_id(options_.server_id);
    return absl::OkStatus();
  }();
  const auto detail = [&] { return absl::StrCat(PoolDetail(req->pool()), " page_token=", Quote(req->page_token())); };
  return scope.Done(FinishCall("ListSequences", detail, status));
}

grpc::Status KvCacheService::GetPage(cq::CallContext*, const v1::GetPageRequest* req, v1::Page* resp) {
  RpcScope scope = StartRpc(kRpcGetPage);
  const absl::Status status = [&]() -> absl::Status {
    MLAKV_ASSIGN_OR_RETURN(Pool * pool, Prelude(req->pool()));
    MLAKV_ASSIGN_OR_RETURN(PageSnapshot page, pool->GetPage(req->page()));
    resp->set_page(static_cast<uint32_t>(page.page));
    resp->set_used(page.used);
    resp->set_sequence(page.sequence);
    resp->set_page_index(page.page_index);
    resp->set_first_position(page.first_position);
    for (size_t l = 0; l < page.filled_per_layer.size(); ++l) {
      resp->add_filled_per_layer(page.filled_per_layer[l]);
      if (page.filled_per_layer[l] > 0) resp->add_layers_written(static_cast<uint32_t>(l));
    }
    resp->set_references(static_cast<uint32_t>(page.references));
    resp->set_indexed(!page.block_hash.empty());
    resp->set_block_hash_hex(absl::BytesToHexString(page.block_hash));
    resp->set_sequence_freed(page.sequence_freed);
    return absl::OkStatus();
  }();
  const auto detail = [&] { return absl::StrCat(PoolDetail(req->pool()), " page=", req->page()); };
  return scope.Done(FinishCall("GetPage", detail, status));
}

grpc::Status KvCacheService::FreeSequence(cq::CallContext* ctx,
                                          const v1::FreeSequenceRequest* req,
                                          v1::FreeSequenceResponse* resp) {
  RpcScope scope = StartRpc(kRpcFreeSequence);
  const absl::Status status = [&]() -> absl::Status {
    MLAKV_ASSIGN_OR_RETURN(Pool * pool, Prelude(req->pool()));
    MLAKV_RETURN_IF_ERROR(CheckFieldLength("sequence", req->sequence(), kMaxSequenceIdBytes));
    MLAKV_RETURN_IF_ERROR(CheckCallAlive(ctx, "nothing was freed"));
    MLAKV_ASSIGN_OR_RETURN(FreeResult freed, pool->FreeSequence(RefOf(*req)));
    resp->set_pages_freed(freed.pages_freed);
    resp->set_leases(freed.leases);
    resp->set_pages_retained(freed.pages_retained);
    return absl::OkStatus();
  }();
  return scope.Done(FinishCall("FreeSequence", [&] { return SequenceDetail(req->pool(), req->sequence()); }, status));
}

grpc::Status KvCacheService::TruncateSequence(cq::CallContext* ctx,
                                              const v1::TruncateSequenceRequest* req,
                                              v1::Sequence* resp) {
  RpcScope scope = StartRpc(kRpcTruncateSequence);
  const absl::Status status = [&]() -> absl::Status {
    MLAKV_ASSIGN_OR_RETURN(Pool * pool, Prelude(req->pool()));
    MLAKV_RETURN_IF_ERROR(CheckFieldLength("sequence", req->sequence(), kMaxSequenceIdBytes));
    MLAKV_RETURN_IF_ERROR(CheckCallAlive(ctx, "nothing was truncated"));
    MLAKV_ASSIGN_OR_RETURN(SequenceSnapshot seq, pool->TruncateSequence(RefOf(*req), req->length()));
    ToProto(pool->name(), seq, resp);
    resp->set_server_id(options_.server_id);
    return absl::OkStatus();
  }();
  const auto detail = [&] {
    return absl::StrCat(SequenceDetail(req->pool(), req->sequence()), " length=", req->length());
  };
  return scope.Done(FinishCall("TruncateSequence", detail, status));
}

// ---- AppendBatch ------------------------------------------------------------------

void KvCacheService::AppendBatch(AppendBatchCall* call) {
  RpcScope scope = StartRpc(kRpcAppendBatch);
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t_entered = Clock::now();
  const v1::AppendBatchRequest* req = &call->request().message;
  auto detail = [req] { return absl::StrCat(PoolDetail(req->pool()), " sequences=", req->sequences_size()); };
  // Shape checks that need no pool state, before the call is queued.
  struct Checked {
    Pool* pool;
    std::optional<DType> dtype;
    v1::SequenceView view;
  };
  absl::StatusOr<Checked> checked = [&]() -> absl::StatusOr<Checked> {
    MLAKV_ASSIGN_OR_RETURN(Pool * pool, Prelude(req->pool()));
    if (const size_t bytes = call->request().wire_bytes; bytes > options_.max_message_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("AppendBatch request is ", bytes,
                                                       " bytes, over this server's max_message_bytes of ",
                                                       options_.max_message_bytes, "; send fewer rows per call"));
    }
    MLAKV_ASSIGN_OR_RETURN(std::optional<DType> dtype, ToDType(req->dtype()));
    MLAKV_ASSIGN_OR_RETURN(v1::SequenceView view, ToView(req->view()));
    // (A sequence named twice is found by AtomicAppend::Begin.)
    for (const v1::SequenceRows& s : req->sequences()) {
      MLAKV_RETURN_IF_ERROR(CheckFieldLength("sequence", s.sequence(), kMaxSequenceIdBytes));
    }
    return Checked{pool, dtype, view};
  }();
  if (!checked.ok()) {
    call->Finish(scope.Done(FinishCall("AppendBatch", detail, checked.status())));
    return;
  }
  AppendStarted();
  Pool* p = checked->pool;
  // Rows by reference behind a producer's CUDA event are waited for before
  // the call takes the pool's worker. The backend waits for such events
  // before it reads, so a batch whose events had not completed -- a
  // layer-wise save's commit sent while the producer's GPU still computes the
  // last layers -- held the worker, and every other append to the pool, until
  // they did, without a limit. Now the pool's SourceWaiter waits (bounded by
  // the call's deadline and append_idle_timeout, ended by a cancel) and the
  // call's task is posted to the worker after; the regions stay held meanwhile.
  RegionHold sources;
  std::vector<const void*> events;
  if (options_.regions->allow_ipc()) events = options_.regions->EventsOf(RegionNamesOf(*req), &sources);
  // One of the pool's worker tasks: on this thread at once when the worker
  // is idle, else queued there and finished from the worker (a batch of
  // many sequences always on the worker: kWorkerThreadSequences).
  const bool short_task = RowLayersOf(*req) <= kKeepTurnRowLayers;
  auto task = std::make_shared<absl::AnyInvocable<void(absl::Status)>>([this, call, scope, c = *checked, t_entered,
                                                                       t_queued = Clock::now(), detail, short_task,
                                                                       sources = std::move(sources)](
                                                                          absl::Status waited) mutable {
    // Run inline, this keeps the queue thread for the step (~0.3 ms for a
    // decode step): another thread polls meanwhile (cq/queue_threads.h),
    // unless the task is short (kKeepTurnRowLayers).
    if (!short_task) cq::QueueThreads::LetAnotherPoll();
    v1::AppendBatchResponse* resp = call->response();
    const ReceivedAppendBatch& received = call->request();
    const v1::AppendBatchRequest* req = &received.message;
    cq::CallContext* ctx = call->context();
    Pool* p = c.pool;
    uint64_t row_bytes = 0;
    // Where the call's time went (logged with the call at debug level): the
    // shape checks, waiting for the pool, rows resolved and sequences begun,
    // staged (the backend's write included), committed, response filled.
    Clock::time_point t_started, t_prepared, t_staged, t_committed, t_done;
    t_started = t_prepared = t_staged = t_committed = Clock::now();
    const absl::Status status = [&]() -> absl::Status {
      if (!waited.ok()) {
        return absl::Status(waited.code(),
                            absl::StrCat("waiting for the producers' CUDA events of the rows by reference (at most "
                                         "the call's deadline and the server's append_idle_timeout_seconds, ",
                                         absl::FormatDuration(options_.append_idle_timeout), "): ", waited.message(),
                                         "; nothing was written"));
      }
      // Queued behind other work: a call whose client gave up meanwhile is not started.
      MLAKV_RETURN_IF_ERROR(CheckCallAlive(ctx, "nothing was written"));
      AtomicAppend append(p);
      RegionHold hold;  // regions named by the rows, until the call ends
      CompactBatchRows compact;
      std::vector<SequenceRowsIn>& rows = compact.sequences;
      if (req->batch_layers_size() > 0) {  // the compact form: each layer's rows of all sequences in one entry
        MLAKV_RETURN_IF_ERROR(ToCompactBatchRows(received, *options_.regions, *p, &hold, &compact));
        std::vector<const std::string*> ids;
        ids.reserve(req->sequences_size());
        for (const v1::SequenceRows& s : req->sequences()) ids.push_back(&s.sequence());
        MLAKV_RETURN_IF_ERROR(append.Begin(ids));
      } else {
        rows.reserve(req->sequences_size());
        for (int i = 0; i < req->sequences_size(); ++i) {
          const v1::SequenceRows& s = req->sequences(i);
          MLAKV_RETURN_IF_ERROR(append.Begin(s.sequence()));
          const std::optional<uint32_t> expect =
              s.has_expect_length() ? std::optional<uint32_t>(s.expect_length()) : std::nullopt;
          MLAKV_ASSIGN_OR_RETURN(SequenceRowsIn r, ToRows(s.sequence(), s.start(), s.row_count(), s.layers(), 0, expect,
                                                          *options_.regions, *p, &hold, received.sequence_pieces(i)));
          AddCacheFields(s, &r);
          rows.push_back(std::move(r));
        }
      }
      for (const SequenceRowsIn& r : rows) {
        row_bytes += static_cast<uint64_t>(r.row_count) * kRowBytes * r.written_layers().size();
      }
      std::vector<const SequenceRowsIn*> row_ptrs;
      row_ptrs.reserve(rows.size());
      for (const SequenceRowsIn& r : rows) row_ptrs.push_back(&r);
      t_prepared = Clock::now();
      MLAKV_RETURN_IF_ERROR(append.Stage(row_ptrs, c.dtype));
      t_staged = Clock::now();
      hold.gathered.clear();
      // The response must fit the send limit: refused now, before the commit,
      // rather than failing at the client after every sequence was written.
      const bool packed = c.view == v1::SEQUENCE_VIEW_PACKED;
      uint64_t bound = 64 + (packed ? kPackedSequencesFixedBytes : 0);
      for (size_t i = 0; i < append.size(); ++i) {
        const AppendTransaction& txn = append.transaction(i);
        const size_t pages = txn.original_pages() + txn.pages_allocated();
        const size_t changed = pages - txn.first_changed_page();  // new pages and copies, and any between
        bound += packed ? PackedSequenceBytesBound(changed, p->num_pages())
                        : SequenceProtoBytesBound(txn.sequence_id().size(), p->name().size(),
                                                  PagesDescribed(c.view, pages, changed),
                                                  p->num_pages(), OnlyNewPages(c.view) ? 0 : p->num_layers());
      }
      auto last_check = [&]() -> absl::Status {
        MLAKV_RETURN_IF_ERROR(hold.CheckNoFaults("AppendBatch"));
        MLAKV_RETURN_IF_ERROR(CheckCallAlive(ctx, "nothing was written"));
        if (bound > options_.max_message_bytes) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "the response would describe ", append.size(), " sequences in up to ", bound, " bytes, over the ",
              options_.max_message_bytes,
              "-byte message limit; nothing was written: ", SmallerViewAdvice(c.view),
              ", or send fewer sequences per call"));
        }
        return absl::OkStatus();
      };
      std::vector<size_t> first_new;
      for (size_t i = 0; i < append.size(); ++i) first_new.push_back(append.transaction(i).first_changed_page());
      const uint64_t rows_written = append.rows_written();
      const uint32_t pages = append.pages_allocated();
      MLAKV_ASSIGN_OR_RETURN(std::vector<SequenceSnapshot> after, append.Commit(last_check, SnapshotPagesFor(c.view)));
      t_committed = Clock::now();
      AddBatchSequences(p->name(), after, first_new, pages, c.view, options_.server_id, resp);
      resp->set_rows_written(rows_written);
      resp->set_pages_allocated(pages);
      return absl::OkStatus();
    }();
    t_done = Clock::now();
    if (!status.ok()) resp->Clear();
    AppendEnded({.method = "AppendBatch",
                 .pool = p->name(),
                 .ok = status.ok(),
                 .rows = resp->rows_written(),
                 .bytes = status.ok() ? row_bytes : 0,
                 .seconds = std::chrono::duration<double>(Clock::now() - t_entered).count()});
    call->Finish(scope.Done(FinishCall(
        "AppendBatch",
        [&] {
          // A phase the call did not reach (it failed before) reads 0.
          auto us = [](Clock::time_point a, Clock::time_point b) {
            return std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::microseconds>(b - a).count());
          };
          return absl::StrCat(detail(), " rows=", resp->rows_written(), " us: checks=", us(t_entered, t_queued),
                              " wait=", us(t_queued, t_started), " prepare=", us(t_started, t_prepared),
                              " stage=", us(t_prepared, t_staged), " commit=", us(t_staged, t_committed),
                              " respond=", us(t_committed, t_done));
        },
        status)));
  });
  if (!events.empty() &&
      p->WhenSourcesComplete(std::move(events), BatchWaitLimits(call->context(), options_.append_idle_timeout),
                             [p, task](absl::Status s) {
                               p->worker().Post([task, s = std::move(s)]() mutable { (*task)(std::move(s)); });
                             })) {
    return;
  }
  if (!short_task && req->sequences_size() >= kWorkerThreadSequences) {
    p->worker().Post([task] { (*task)(absl::OkStatus()); });
    return;
  }
  p->worker().RunOrPost([task] { (*task)(absl::OkStatus()); });
}

// ---- streams (their call objects: append_reactor.cc, read_reactor.cc, watch_events_reactor.cc) ----

absl::Status KvCacheService::WatcherStarted() {
  watchers_.fetch_add(1);
  if (draining()) return DrainingError();
  if (options_.events == nullptr) return absl::UnimplementedError("this server records no KV events");
  if (watchers_.load() > options_.max_watchers) {
    return absl::ResourceExhaustedError(absl::StrCat(options_.max_watchers,
                                                     " WatchEvents streams are open, this server's limit; close one "
                                                     "(routers need one stream per server)"));
  }
  return absl::OkStatus();
}

// ---- regions (docs/server.md "Regions") ---------------------------------------------

void KvCacheService::RegisterShmRegion(RegisterShmRegionCall* call) {
  const v1::RegisterShmRegionRequest* req = &call->request();
  std::string detail = absl::StrCat("name=", Quote(req->name()), " shm_name=", Quote(req->shm_name()),
                                    " offset=", req->offset(), " byte_size=", req->byte_size());
  absl::Status refused = draining() ? DrainingError() : options_.regions->CheckAllowed("RegisterShmRegion");
  if (!refused.ok()) {
    call->Finish(FinishCall("RegisterShmRegion", [&] { return detail; }, refused));
    return;
  }
  RegionRegistry* regions = options_.regions;
  // Opening and mapping run on the registry's worker, never on a queue thread.
  regions->worker().Post([call, req, regions, detail = std::move(detail)] {
    absl::Status status = CheckCallAlive(call->context(), "nothing was registered");
    if (status.ok()) {
      absl::StatusOr<RegionInfo> region = regions->RegisterShm(
          req->name(), {.shm_name = req->shm_name(), .offset = req->offset(), .byte_size = req->byte_size()});
      if (region.ok()) *call->response() = ToProto(*region);
      status = region.status();
    }
    call->Finish(FinishCall("RegisterShmRegion", [&] { return detail; }, status));
  });
}

void KvCacheService::RegisterCudaRegion(RegisterCudaRegionCall* call) {
  const v1::RegisterCudaRegionRequest* req = &call->request();
  std::string detail = absl::StrCat("name=", Quote(req->name()), " device_id=", req->device_id(),
                                    " byte_size=", req->byte_size());
  absl::Status refused = draining() ? DrainingError() : options_.regions->CheckAllowed("RegisterCudaRegion");
  if (!refused.ok()) {
    call->Finish(FinishCall("RegisterCudaRegion", [&] { return detail; }, refused));
    return;
  }
  RegionRegistry* regions = options_.regions;
  regions->worker().Post([call, req, regions, detail = std::move(detail)] {
    absl::Status status = CheckCallAlive(call->context(), "nothing was registered");
    if (status.ok()) {
      absl::StatusOr<RegionInfo> region = regions->RegisterCuda(req->name(), {.raw_handle = req->raw_handle(),
                                                                              .device_id = req->device_id(),
                                                                              .byte_size = req->byte_size(),
                                                                              .raw_event_handle = req->raw_event_handle()});
      if (region.ok()) *call->response() = ToProto(*region);
      status = region.status();
    }
    call->Finish(FinishCall("RegisterCudaRegion", [&] { return detail; }, status));
  });
}

grpc::Status KvCacheService::UnregisterRegion(cq::CallContext*,
                                              const v1::UnregisterRegionRequest* req,
                                              v1::UnregisterRegionResponse* resp) {
  RpcScope scope = StartRpc(kRpcUnregisterRegion);
  const std::string detail = absl::StrCat("name=", Quote(req->name()));
  if (draining()) return scope.Done(FinishCall("UnregisterRegion", [&] { return std::string(detail); }, DrainingError()));
  absl::StatusOr<uint32_t> holders = options_.regions->Unregister(req->name());  // releases on the registry's worker
  if (holders.ok()) resp->set_appends_in_flight(*holders);
  return scope.Done(FinishCall("UnregisterRegion", [&] { return std::string(detail); }, holders.status()));
}

grpc::Status KvCacheService::ListRegions(cq::CallContext*,
                                         const v1::ListRegionsRequest*, v1::ListRegionsResponse* resp) {
  RpcScope scope = StartRpc(kRpcListRegions);
  if (draining()) return scope.Done(FinishCall("ListRegions", [&] { return std::string(""); }, DrainingError()));
  absl::StatusOr<std::vector<RegionInfo>> regions = options_.regions->List();
  if (regions.ok()) {
    for (const RegionInfo& r : *regions) *resp->add_regions() = ToProto(r);
  }
  return scope.Done(FinishCall("ListRegions", [&] { return std::string(""); }, regions.status()));
}

grpc::Status KvCacheService::ExportPool(cq::CallContext*,
                                        const v1::ExportPoolRequest* req, v1::ExportPoolResponse* resp) {
  RpcScope scope = StartRpc(kRpcExportPool);
  const absl::Status status = [&]() -> absl::Status {
    if (draining()) return DrainingError();
    MLAKV_RETURN_IF_ERROR(options_.regions->CheckAllowed("ExportPool"));
    MLAKV_ASSIGN_OR_RETURN(Pool * pool, Prelude(req->pool()));
    absl::StatusOr<std::vector<CacheBackend::LayerHandles>> handles = pool->ExportHandles();
    if (!handles.ok()) return WithContext(handles.status(), absl::StrCat("pool ", Quote(pool->name())));
    const PoolSnapshot snap = pool->Snapshot();
    const uint64_t entries = static_cast<uint64_t>(snap.pages_total) * snap.page_size;
    resp->set_pool(snap.name);
    resp->set_device_id(snap.device.ordinal());  // only cuda pools export
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
  return scope.Done(FinishCall("ExportPool", [&] { return PoolDetail(req->pool()); }, status));
}

}  // namespace mlakv::server
