#include "server/rpc/append_reactor.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "kernels/nvfp4_format.h"
#include "server/rpc/call_support.h"
#include "server/rpc/grpc_status.h"
#include "server/rpc/proto_convert.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {
namespace {

// Bytes of one row of ckv + kpe (both dtypes have 2-byte elements).
constexpr uint64_t kRowBytes = (format::kCkvDim + format::kKpeDim) * 2;
// A message this large has its slot released off the pool's worker (Process).
constexpr size_t kOffWorkerBytes = 256 * 1024;

}  // namespace

void AppendReactor::Request(void* tag) {
  grpc::ServerCompletionQueue* queue = queue_->queue();
  service_->async()->RequestAppend(&ctx_, reader(), queue, queue, tag);
}

void AppendReactor::OnStart() {
  transport_ = &service_->NextTransport();
  started_ = absl::Now();
  if (service_->draining()) {
    {
      absl::MutexLock lock(&mu_);
      finishing_ = true;
      finish_taken_ = true;
    }
    Done(DrainingError());
    return;
  }
  service_->AppendStarted();
  counted_ = true;
  {
    absl::MutexLock lock(&mu_);
    last_activity_ = started_;
    reading_ = 0;
  }
  registered_ = true;
  service_->watchdog().Add(this);
  StartRead(&slots_[0].raw);
}

// ---- reader side -----------------------------------------------------------------

void AppendReactor::OnReadDone(bool ok) {
  int got = -1, index = 0;
  bool end_committed = false;
  {
    absl::MutexLock lock(&mu_);
    got = reading_;
    reading_ = -1;
    last_activity_ = absl::Now();
    if (finish_at_half_close_) {
      // Committed by CommitAppend (Done): the stream's end waited for this
      // read -- the half-close, a cancel, or a message it will not write.
      finish_at_half_close_ = false;
      end_committed = true;
    } else {
      if (finishing_ || doomed_) {
        // The stream is being finished; this read is dropped. A message
        // after a commit by CommitAppend, which Done may not have seen yet
        // waiting to finish the stream, is what the stream then ends with.
        if (ok) message_after_finish_ = true;
        return;
      }
      if (ok) index = ++messages_received_;
      if (ok && commit_call_ != nullptr && index > commit_after_) {
        if (commit_certain_) {
          // Too late to roll back: the commit passed its last check and
          // lands with the messages named. This one is dropped, and is what
          // the stream ends with (Done).
          message_after_finish_ = true;
          return;
        }
        FailLocked(absl::FailedPreconditionError(
            absl::StrCat("message ", index, " of the Append stream came after CommitAppend named ", commit_after_,
                         " messages; the whole append was rolled back")));
        return;
      }
    }
  }
  if (end_committed) {
    Finish(ok ? MessageAfterCommitStatus() : grpc::Status::OK);
  } else if (ok) {
    OnMessage(got, index);
  } else {
    OnStreamEnd();
  }
}

void AppendReactor::OnMessage(int got, int index) {
  // The slot is this read's alone until it is marked busy: parse without mu_.
  Slot& slot = slots_[got];
  const size_t raw_bytes = slot.raw.Length();
  slot.raw_bytes = raw_bytes;
  // Parsing a large message keeps this queue thread for a while (~0.1 ms a
  // MB): another thread polls meanwhile, reading the other streams' bytes.
  if (raw_bytes >= kOffWorkerBytes) cq::QueueThreads::LetAnotherPoll();
  const uint32_t max_bytes = service_->options().max_message_bytes;
  const bool too_large = raw_bytes > max_bytes;
  const bool parsed = !too_large && ParseAppendMessage(&slot.raw, &slot.received);
  if (too_large) slot.raw.Clear();
  // The first message's commit_token goes into the service's registry
  // before mu_ is taken (the registry's mutex comes first, open_appends.h).
  absl::Status token = absl::OkStatus();
  if (parsed && index == 1 && !slot.received.message.commit_token().empty()) {
    token = RegisterCommitToken(slot.received.message.commit_token());
  }
  int next_read = -1;
  bool commit = false;
  std::optional<absl::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    if (too_large) {
      FailLocked(absl::ResourceExhaustedError(absl::StrCat(
          "message ", index, " of the Append stream is ", raw_bytes, " bytes, over this server's max_message_bytes of ",
          max_bytes, "; the whole append was rolled back. Split the rows into smaller messages")));
    } else if (!parsed) {
      FailLocked(absl::InvalidArgumentError(absl::StrCat(
          "message ", index, " of the Append stream (", raw_bytes,
          " bytes) is not a valid mlakv.v1.AppendRequest: a truncated or malformed protobuf, or a string field "
          "(pool, sequence, region) that is not valid UTF-8; the whole append was rolled back")));
    } else if (!token.ok()) {
      FailLocked(std::move(token));
    } else if (pool_ == nullptr) {
      // The first message names the pool and the sequence for the stream.
      const v1::AppendRequest& first = slot.received.message;
      absl::Status named = CheckFieldLength("pool", first.pool());
      if (named.ok()) named = CheckFieldLength("sequence", first.sequence(), kMaxSequenceIdBytes);
      absl::StatusOr<v1::SequenceView> view = ToView(first.view());
      if (named.ok()) named = view.status();
      if (named.ok() && *view == v1::SEQUENCE_VIEW_PACKED) {
        named = absl::InvalidArgumentError(
            "view SEQUENCE_VIEW_PACKED answers an AppendBatch's sequences; an Append stream answers one sequence: ask "
            "for SEQUENCE_VIEW_COMPACT or SEQUENCE_VIEW_LENGTHS");
      }
      absl::StatusOr<Pool*> pool = named.ok() ? service_->FindPool(first.pool()) : absl::StatusOr<Pool*>(named);
      if (!pool.ok()) {
        FailLocked(pool.status());
      } else {
        pool_ = *pool;
        pool_field_ = first.pool();
        sequence_ = first.sequence();
        view_ = *view;
      }
    }
    if (!doomed_ && !finishing_) {
      slot.busy = true;
      ++queued_;
      pool_->worker().Post([this, got, index] { Process(got, index); });
      ++messages_posted_;
      commit = TakeDueCommitLocked();  // the last message CommitAppend named
      next_read = TakeFreeSlotLocked();
    }
    finish = TakeFinishLocked();
  }
  if (finish) Done(*finish);
  if (commit) StartCommit();
  if (next_read >= 0) StartReadInto(next_read);
}

absl::Status AppendReactor::RegisterCommitToken(const std::string& token) {
  MLAKV_RETURN_IF_ERROR(CheckFieldLength("commit_token", token, kMaxCommitTokenBytes));
  MLAKV_RETURN_IF_ERROR(service_->open_appends().Add(token, this));
  commit_token_ = token;
  token_registered_ = true;
  return absl::OkStatus();
}

bool AppendReactor::OnCommitRequested(CommitAppendCall* call, uint32_t messages, KvCacheService::RpcScope scope) {
  absl::MutexLock lock(&mu_);
  commit_call_ = call;  // answered by Done, whatever happens next
  commit_scope_.emplace(scope);
  commit_after_ = static_cast<int>(std::min<uint32_t>(messages, INT32_MAX));
  const bool count_wrong =
      messages_received_ > commit_after_ || (commit_started_ && messages_received_ < commit_after_);
  if (count_wrong && commit_certain_) {
    // The half-close's commit passed its last check (or landed): it stands,
    // and only this call, which named another count, is refused.
    commit_call_status_ = absl::FailedPreconditionError(absl::StrCat(
        "CommitAppend named ", messages, " messages, but the Append stream had ended after ", messages_received_,
        " and its half-close committed them first; that commit stands"));
    return false;
  }
  if (finishing_ || doomed_) return false;
  // The token came with the first message, so a pool is named by the time a
  // second message or the half-close is read: FailLocked posts a rollback.
  if (count_wrong) {
    FailLocked(absl::FailedPreconditionError(absl::StrCat(
        "CommitAppend named ", messages, " messages, but the Append stream ",
        commit_started_ ? "ended after " : "has already carried ", messages_received_,
        "; the whole append was rolled back")));
    return false;
  }
  return TakeDueCommitLocked();
}

bool AppendReactor::TakeDueCommitLocked() {
  if (commit_call_ == nullptr || commit_started_ || finishing_ || doomed_ || pool_ == nullptr ||
      messages_posted_ != commit_after_) {
    return false;
  }
  StartCommitLocked();
  end_.by_call = true;
  return true;
}

void AppendReactor::StartCommitLocked() {
  end_.closed = std::chrono::steady_clock::now();
  commit_started_ = true;
  ++queued_;
}

void AppendReactor::StartCommit() {
  // Here at once when the pool's worker is idle -- the usual case at the end
  // of a layer-wise save, whose messages were all handled, and whose layers
  // were all written once their events completed (WriteEveryLayerWhenReady),
  // while the producer computed: the commit then costs no wake-up of the
  // worker (an idle thread of a virtual machine's host, 0.1-0.4 ms on the
  // GPU host). Queued behind the worker's tasks otherwise. Complete hands
  // rows still held to the worker; it never writes or waits here.
  pool_->worker().RunOrPost([this] { Complete(absl::OkStatus()); });
}

void AppendReactor::OnStreamEnd() {
  // Not a clean half-close when the call broke: a failed read (client
  // cancel, message over the size limit, transport error, deadline) marks
  // the call cancelled before OnReadDone(false) runs.
  const absl::Status alive = CheckCallAlive(&ctx_, "the whole append was rolled back");
  std::optional<absl::Status> finish;
  bool commit = false;
  {
    absl::MutexLock lock(&mu_);
    if (finishing_ || doomed_) {
      // A message failed on the worker while this read was ending: the stream
      // is finishing (maybe finished), and nothing may be queued behind it.
      // (Posting the commit here let it run after OnDone; found by
      // request_validation_fuzzer under UBSan.)
    } else if (!alive.ok()) {
      FailLocked(absl::Status(alive.code(),
                              absl::StrCat("the Append stream broke before a clean end (", alive.message(),
                                           "; a message over the size limit, a cancel or a lost connection end a "
                                           "stream this way)")));
    } else if (pool_ == nullptr) {
      finishing_ = true;
      finish_status_ = absl::InvalidArgumentError("Append stream carried no message");
    } else if (commit_started_) {
      // CommitAppend's commit is under way: the half-close adds nothing.
    } else if (commit_call_ != nullptr) {
      FailLocked(absl::FailedPreconditionError(absl::StrCat(
          "the Append stream ended after ", messages_received_, " messages, but CommitAppend named ", commit_after_,
          "; the whole append was rolled back")));
    } else {
      // A clean half-close: commit as one of the pool's tasks, after every
      // message queued before it (below, outside mu_).
      StartCommitLocked();
      commit = true;
    }
    finish = TakeFinishLocked();
  }
  if (finish) Done(*finish);
  if (commit) StartCommit();
}

void AppendReactor::FailLocked(absl::Status status) {
  if (doomed_ || finishing_) return;
  ending_.store(true, std::memory_order_relaxed);
  doomed_ = true;
  doom_status_ = status;
  if (pool_ == nullptr && queued_ == 0) {
    // Nothing was staged and nothing is queued: finish directly.
    finishing_ = true;
    finish_status_ = std::move(status);
    return;
  }
  ++queued_;
  SerialExecutor& worker = pool_ != nullptr ? pool_->worker() : service_->control();
  worker.Post([this, status = std::move(status)] { Fail(status); });
}

int AppendReactor::TakeFreeSlotLocked() {
  for (int b = 0; b < 2; ++b) {
    if (!slots_[b].busy) {
      reading_ = b;
      ++starting_reads_;  // Finish waits until StartRead has been called
      return b;
    }
  }
  read_wanted_ = true;
  return -1;
}

void AppendReactor::StartReadInto(int slot) {
  StartRead(&slots_[slot].raw);
  std::optional<absl::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    --starting_reads_;
    finish = TakeFinishLocked();
  }
  if (finish) Done(*finish);
}

void AppendReactor::OnWatchdogTick(absl::Time now) {
  const absl::Duration limit = service_->options().append_idle_timeout;
  bool end_committed = false;
  std::optional<absl::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    if (finish_at_half_close_) {
      // Committed by CommitAppend and not half-closed since: ended, with the
      // commit's OK, at the idle timeout.
      if (now - committed_at_ < limit) return;
      finish_at_half_close_ = false;
      end_committed = true;
    } else {
      // Idle: waiting for the client's next message (a read in flight), with
      // nothing received or processed for the whole timeout.
      if (finishing_ || doomed_ || reading_ < 0 || now - last_activity_ < limit) return;
      FailLocked(absl::DeadlineExceededError(absl::StrCat(
          "the Append stream delivered no message for ", absl::FormatDuration(limit),
          " (the server's append_idle_timeout_seconds) after message ", messages_received_,
          "; the whole append was rolled back")));
      // With no first message yet, nothing is staged or queued: FailLocked
      // posted no rollback, and the finish is this caller's to take.
      finish = TakeFinishLocked();
    }
  }
  // OnDone, which removes this stream from the watchdog, waits for this tick to return.
  if (end_committed) Finish(grpc::Status::OK);
  // Done logs and counts the call: off the watchdog's thread, which ticks every stream under its lock.
  if (finish) service_->control().Post([this, status = *std::move(finish)] { Done(status); });
}

// ---- worker side -----------------------------------------------------------------

void AppendReactor::Process(int slot, int index) {
  bool skip;
  {
    absl::MutexLock lock(&mu_);
    skip = finishing_ || doomed_;
  }
  const absl::Status status = skip ? absl::OkStatus() : ProcessMessage(slots_[slot].received, index);
  if (!skip && status.ok()) WriteEveryLayerWhenReady();
  if (!status.ok()) {
    ending_.store(true, std::memory_order_relaxed);
    // Here, before the next task (a commit) runs on this worker.
    absl::MutexLock lock(&mu_);
    if (!finishing_) {
      finishing_ = true;
      finish_status_ = status;
    }
  }
  // The rows are staged. Giving the slices back, the next read and a finish
  // are the transport's: off the worker when another task waits there and
  // the message brought its rows as bytes (megabytes of slices to free; a
  // message by reference is a few hundred bytes, not worth a thread hop).
  // This task stays counted in queued_ until Release has run.
  if (slots_[slot].raw_bytes >= kOffWorkerBytes) {
    OffWorker([this, slot] { Release(slot); });
  } else {
    Release(slot);
  }
}

void AppendReactor::Release(int slot) {
  slots_[slot].received.Clear();  // the transport's slices go back
  int next_read = -1;
  std::optional<absl::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    slots_[slot].busy = false;
    --queued_;
    last_activity_ = absl::Now();
    if (!finishing_ && !doomed_ && read_wanted_) {
      read_wanted_ = false;
      next_read = TakeFreeSlotLocked();
    }
    finish = TakeFinishLocked();
  }
  if (finish) Done(*finish);
  if (next_read >= 0) StartReadInto(next_read);
}

void AppendReactor::WriteEveryLayerWhenReady() {
  if (early_write_pending_ || append_ == nullptr || !append_->holds_every_layer()) return;
  {
    absl::MutexLock lock(&mu_);
    if (finishing_ || doomed_) return;
    ++queued_;  // the write's task: the stream cannot finish before it has run
  }
  early_write_pending_ = true;
  // Given up once the commit has begun (it writes what is still held), the
  // stream fails or the call is cancelled. Until then it runs beside the
  // commit's own wait for the same events (a save whose stream ends while
  // the GPU still computes): whichever sees them complete first writes. At
  // the server's append_idle_timeout a producer that never completes is the
  // commit's to report.
  WaitLimits limits{.deadline = absl::Now() + service_->options().append_idle_timeout,
                    .abandoned = [this] { return ending_.load(std::memory_order_relaxed) || ctx_.cancelled(); }};
  // As the commit's wait: the write follows the events at once while
  // nothing else is queued (no wake-up of the worker), else comes back once
  // they have completed (the stream's own half-close queued is enough to
  // hand it over). Written here, in this message's task, which keeps the
  // stream from finishing meanwhile; a wait that failed writes nothing (the
  // commit waits again and says why).
  absl::StatusOr<bool> ready = WaitHereOrHandOver(append_->HeldWaitEvents(), std::move(limits),
                                                  [this](absl::Status s) { WriteHeldEarly(std::move(s)); });
  if (!ready.ok()) {
    WriteHeldEarly(ready.status());
  } else if (*ready) {
    WriteHeldEarly(absl::OkStatus());
  }
}

absl::StatusOr<bool> AppendReactor::WaitHereOrHandOver(std::vector<const void*> events, WaitLimits limits,
                                                       absl::AnyInvocable<void(absl::Status) &&> then) {
  absl::StatusOr<bool> here = pool_->WaitForSourcesHere(events, limits);
  if (!here.ok() || *here) return here;
  return !pool_->WhenSourcesComplete(std::move(events), std::move(limits),
                                     [this, then = std::move(then)](absl::Status s) mutable {
                                       pool_->worker().Post([then = std::move(then), s = std::move(s)]() mutable {
                                         std::move(then)(std::move(s));
                                       });
                                     });
}

void AppendReactor::WriteHeldEarly(absl::Status waited) {
  early_write_pending_ = false;
  bool skip;
  {
    absl::MutexLock lock(&mu_);
    skip = finishing_ || doomed_;
  }
  // A wait that ended otherwise (late, cancelled, a failed query) writes
  // nothing: the commit waits again and says why, or the stream is failing.
  // Nor does one whose layers were flushed meanwhile by a message that named
  // one again: what is held now is not every layer (what is, the backend
  // still waits for before it reads).
  absl::Status written = absl::OkStatus();
  if (!skip && waited.ok() && append_->holds_every_layer()) {
    written = append_->WriteHeld();
    wrote_early_ = written.ok();
  }
  std::optional<absl::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    --queued_;
    if (!written.ok() && !finishing_) {
      finishing_ = true;
      finish_status_ =
          absl::Status(written.code(), absl::StrCat(written.message(), " (writing every layer the stream had sent; the "
                                                                       "whole append was rolled back)"));
    }
    finish = TakeFinishLocked();
  }
  if (finish) FinishOffWorker(*std::move(finish));
}

absl::Status AppendReactor::ProcessMessage(const ReceivedAppend& received, int index) {
  const v1::AppendRequest& req = received.message;
  messages_processed_.store(index);
  absl::Status status = [&]() -> absl::Status {
    // Queued behind other work, a message whose client has gone is not
    // staged: its pages (maybe another sequence's, evicted for it) would
    // only come back at the rollback.
    MLAKV_RETURN_IF_ERROR(CheckCallAlive(&ctx_, absl::StrCat("message ", index, " was not staged")));
    if (index > 1) {
      if (!req.pool().empty() && req.pool() != pool_field_) {
        return absl::InvalidArgumentError(absl::StrCat("message ", index, " names pool ", Quote(req.pool()),
                                                       " but the stream's first message named ", Quote(pool_field_),
                                                       "; leave it empty after the first message"));
      }
      if (!req.sequence().empty() && req.sequence() != sequence_) {
        return absl::InvalidArgumentError(absl::StrCat("message ", index, " names sequence ", Quote(req.sequence()),
                                                       " but the stream is for ", Quote(sequence_),
                                                       "; one Append stream writes one sequence"));
      }
      if (req.reserve_tokens() != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "message ", index, " sets reserve_tokens; only the first message of a stream may reserve"));
      }
      if (req.has_expect_generation() || req.pin()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "message ", index, " sets expect_generation or pin; only the first message of a stream may"));
      }
      if (req.view() != v1::SEQUENCE_VIEW_UNSPECIFIED) {
        return absl::InvalidArgumentError(
            absl::StrCat("message ", index, " sets view; only the first message of a stream chooses the view"));
      }
      if (!req.commit_token().empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "message ", index, " sets commit_token; only the first message of a stream names it"));
      }
    }
    MLAKV_ASSIGN_OR_RETURN(std::optional<DType> dtype, ToDType(req.dtype()));
    if (append_ == nullptr) {
      append_ = std::make_unique<AtomicAppend>(pool_);
      // Rows by reference are quantized at the end of the stream, all layers
      // in one launch, not message by message while the producer computes.
      append_->HoldDeviceWrites();
      MLAKV_RETURN_IF_ERROR(append_->Begin(sequence_));
    }
    const std::optional<uint32_t> expect =
        req.has_expect_length() ? std::optional<uint32_t>(req.expect_length()) : std::nullopt;
    MLAKV_ASSIGN_OR_RETURN(SequenceRowsIn rows, ToRows(sequence_, req.start(), req.row_count(), req.layers(),
                                                       req.reserve_tokens(), expect, *service_->options().regions,
                                                       *pool_, &regions_held_, received.rows));
    AddCacheFields(req, &rows);  // later messages cannot name a generation or a pin (checked above)
    rows.pin = req.pin();
    const SequenceRowsIn* rows_ptr = &rows;
    const absl::Status staged = append_->Stage({&rows_ptr, 1}, dtype);
    // The rows are in the cache now: packed copies of strided region rows
    // go (the regions themselves stay held until the stream ends).
    regions_held_.gathered.clear();
    MLAKV_RETURN_IF_ERROR(staged);
    MLAKV_RETURN_IF_ERROR(regions_held_.CheckNoFaults(absl::StrCat("sequence ", Quote(sequence_))));
    row_bytes_ += static_cast<uint64_t>(req.row_count()) * kRowBytes * rows.layers.size();
    return absl::OkStatus();
  }();
  if (status.ok()) return status;
  if (append_ != nullptr) append_->Abort();
  return absl::Status(status.code(),
                      absl::StrCat(status.message(), index > 1 ? absl::StrCat(" (message ", index,
                                                                              " of the stream; the whole append was "
                                                                              "rolled back)")
                                                               : ""));
}

void AppendReactor::Complete(absl::Status waited) {
  bool skip;
  {
    absl::MutexLock lock(&mu_);
    skip = finishing_ || doomed_;
  }
  // Rows held by reference behind producers' events that have not all
  // completed (a layer-wise save ends its stream while the GPU still
  // computes its last layers): the commit comes back here once they have,
  // and the worker serves other appends meanwhile (server/core/source_waiter.h).
  // This task stays counted in queued_ until then, so the stream cannot finish.
  // While nothing else is queued on the worker the wait is spent here, so
  // the write follows the events at once (handed over, the commit came
  // ~0.25 ms later on the H200, docs/performance.md).
  if (!skip && !sources_waited_ && append_ != nullptr) {
    // Run in place on a completion-queue thread (OnStreamEnd), a commit
    // neither spins on a producer's events nor launches GPU work: rows still
    // held (not written early -- the stream did not name every layer, or
    // their events had not completed) are the worker's to write. A one-row
    // stream by reference took 277 us at the least with its write in place
    // against 147 us posted (H200 host, 2026-12-06, docs/performance.md).
    if (append_->holds_writes() && !pool_->worker().OnWorkerThread()) {
      pool_->worker().Post([this] { Complete(absl::OkStatus()); });
      return;
    }
    std::vector<const void*> events = append_->HeldWaitEvents();
    end_.task = std::chrono::steady_clock::now();
    sources_waited_ = true;
    // A client that cancels (or a server shutdown that cancels the call once
    // its grace is over) ends the wait at once: rolled back below.
    WaitLimits limits{.deadline = absl::Now() + service_->options().append_idle_timeout,
                      .abandoned = [ctx = &ctx_] { return ctx->cancelled(); }};
    absl::StatusOr<bool> ready =
        WaitHereOrHandOver(std::move(events), std::move(limits), [this](absl::Status s) { Complete(std::move(s)); });
    if (!ready.ok()) {
      waited = ready.status();
    } else if (!*ready) {
      return;
    }
  }
  // The commit (or the rollback) takes over from an early write still waited for.
  ending_.store(true, std::memory_order_relaxed);
  absl::Status status = absl::OkStatus();
  if (!skip && !waited.ok()) {
    append_->Abort();
    status = absl::Status(
        waited.code(),
        absl::StrCat("waiting for the producer's CUDA events of the rows by reference (at most the server's "
                     "append_idle_timeout_seconds, ",
                     absl::FormatDuration(service_->options().append_idle_timeout), "): ", waited.message(),
                     "; the whole append was rolled back"));
  } else if (!skip) {
    end_.sources = std::chrono::steady_clock::now();
    status = CommitStream();
    end_.committed = std::chrono::steady_clock::now();
  }
  std::optional<absl::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    --queued_;
    if (!skip && !finishing_) {
      finishing_ = true;
      finish_status_ = status;
    }
    finish = TakeFinishLocked();
  }
  if (finish) FinishOffWorker(*std::move(finish));
}

absl::Status AppendReactor::CommitStream() {
  if (append_ == nullptr || append_->size() != 1) return absl::InternalError("Append ended without a transaction");
  const AppendTransaction& txn = append_->transaction(0);
  const size_t pages = txn.original_pages() + txn.pages_allocated();
  const size_t first_new = txn.first_changed_page();
  const uint32_t max_bytes = service_->options().max_message_bytes;
  auto last_check = [&]() -> absl::Status {
    MLAKV_RETURN_IF_ERROR(regions_held_.CheckNoFaults(absl::StrCat("sequence ", Quote(sequence_))));
    MLAKV_RETURN_IF_ERROR(CheckCallAlive(&ctx_, "the whole append was rolled back"));
    {
      absl::MutexLock lock(&mu_);
      if (doomed_) return doom_status_;  // e.g. the call broke, or a message came after CommitAppend's count
    }
    const uint64_t bound = SequenceProtoBytesBound(sequence_.size(), pool_->name().size(),
                                                   PagesDescribed(view_, pages, pages - first_new), pool_->num_pages(),
                                                   OnlyNewPages(view_) ? 0 : pool_->num_layers()) +
                           32;
    if (bound > max_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the response would describe ", pages, " pages (up to ", bound, " bytes), over the ", max_bytes,
          "-byte message limit; nothing was written: ", SmallerViewAdvice(view_), " in the first message"));
    }
    {
      // The last word: AtomicAppend::Commit cannot fail after this check, so
      // a doom read from here on (a message after CommitAppend's count, a
      // CommitAppend naming another count) finds commit_certain_ and leaves
      // the commit standing instead of claiming a rollback.
      absl::MutexLock lock(&mu_);
      if (doomed_) return doom_status_;  // doomed during the size check
      commit_certain_ = true;
    }
    if (service_->options().after_last_check_for_testing) service_->options().after_last_check_for_testing();
    return absl::OkStatus();
  };
  const uint64_t rows = append_->rows_written();
  const uint32_t allocated = append_->pages_allocated();
  MLAKV_ASSIGN_OR_RETURN(std::vector<SequenceSnapshot> after, append_->Commit(last_check, SnapshotPagesFor(view_)));
  v1::AppendResponse response;
  ToProto(pool_->name(), after.front(), response.mutable_sequence(), view_, first_new);
  if (NamesSequence(view_)) response.mutable_sequence()->set_server_id(service_->options().server_id);
  response.set_rows_written(rows);
  response.set_pages_allocated(allocated);
  bool own = false;
  if (grpc::Status s = grpc::SerializationTraits<v1::AppendResponse>::Serialize(response, this->response(), &own); !s.ok()) {
    // Committed already; cannot happen for a message this small.
    spdlog::error("Append {}: serializing the response failed: {}", Detail(), s.error_message());
  }
  if (token_registered_) committed_ = std::move(response);  // CommitAppend's answer (AnswerCommitCall)
  return absl::OkStatus();
}

void AppendReactor::Fail(const absl::Status& status) {
  if (append_ != nullptr) append_->Abort();
  std::optional<absl::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    --queued_;
    if (!finishing_) {
      finishing_ = true;
      finish_status_ = status;
    }
    finish = TakeFinishLocked();
  }
  if (finish) FinishOffWorker(*std::move(finish));
}

// ---- finishing ------------------------------------------------------------------

std::optional<absl::Status> AppendReactor::TakeFinishLocked() {
  if (!finishing_ || queued_ > 0 || starting_reads_ > 0 || finish_taken_) return std::nullopt;
  finish_taken_ = true;
  return finish_status_;
}

void AppendReactor::FinishOffWorker(absl::Status status) {
  // Finish was taken (TakeFinishLocked): nothing else of this reactor runs
  // now, and OnDone cannot come before this Finish.
  OffWorker([this, status = std::move(status)] { Done(status); });
}

void AppendReactor::OffWorker(absl::AnyInvocable<void() &&> step) {
  // pending() counts the task running now. Alone on the worker, a hop would
  // only add a thread wake-up to this stream's latency.
  if (pool_ == nullptr || pool_->worker().pending() <= 1) {
    std::move(step)();
  } else {
    transport_->Post(std::move(step));
  }
}

std::string AppendReactor::Detail() const {
  return absl::StrCat("pool=", Quote(pool_ ? pool_->name() : pool_field_), " sequence=", Quote(sequence_),
                      " messages=", messages_processed_.load());
}

void AppendReactor::AnswerCommitCall(const absl::Status& status) {
  // Off the registry first: a CommitAppend that finds this stream from now
  // on cannot (NOT_FOUND), and one that found it before has left its call.
  if (token_registered_) service_->open_appends().Remove(commit_token_, this);
  CommitAppendCall* call;
  std::optional<KvCacheService::RpcScope> scope;
  absl::Status answer = status;
  {
    absl::MutexLock lock(&mu_);
    call = std::exchange(commit_call_, nullptr);
    scope = commit_scope_;
    if (commit_call_status_) answer = *commit_call_status_;  // the call's own refusal (OnCommitRequested)
  }
  if (call == nullptr) return;
  if (answer.ok()) *call->response() = std::move(committed_);
  const auto detail = [&] { return absl::StrCat("commit_token=", Quote(commit_token_), " ", Detail()); };
  call->Finish(scope->Done(FinishCall("CommitAppend", detail, answer)));
}

void AppendReactor::Done(const absl::Status& status) {
  const auto answering = std::chrono::steady_clock::now();
  AnswerCommitCall(status);
  const uint64_t rows = append_ != nullptr && status.ok() ? append_->rows_written() : 0;
  std::string end;
  if (status.ok() && end_.task != std::chrono::steady_clock::time_point() &&
      end_.committed != std::chrono::steady_clock::time_point()) {
    // From the half-close: to the commit task, the producers' events, the
    // write and commit, and this (the response about to go).
    const auto us = [](auto a, auto b) { return std::chrono::duration_cast<std::chrono::microseconds>(b - a).count(); };
    end = absl::StrCat(" end us: to_task=", us(end_.closed, end_.task), " events=", us(end_.task, end_.sources),
                       " write_commit=", us(end_.sources, end_.committed),
                       " to_respond=", us(end_.committed, answering),
                       wrote_early_ ? " written_before_end=1" : "", end_.by_call ? " by=CommitAppend" : "");
  }
  LogCall("Append", absl::StrCat(Detail(), " rows=", rows, end), status);
  if (counted_) {
    // Before Finish: OnDone (and the service's destruction) may follow at once.
    service_->AppendEnded({.method = "Append",
                           .pool = pool_ != nullptr ? pool_->name() : "",
                           .ok = status.ok(),
                           .rows = rows,
                           .bytes = status.ok() ? row_bytes_ : 0,
                           .seconds = absl::ToDoubleSeconds(absl::Now() - started_)});
  }
  bool message_after_commit = false;
  if (status.ok() && end_.by_call) {
    // Committed by CommitAppend: the stream's own end waits for the client's
    // half-close (or a cancel, or the idle timeout), so that its answer does
    // not reach the client together with the call's -- in gRPC Python the
    // stream's answer is a Python callback on the channel's thread, which
    // took the interpreter from the caller returning from CommitAppend
    // (~0.2-0.35 ms a save on the development VM, docs/performance.md).
    // The read may have ended already, the call being answered above: a
    // message then was dropped (OnReadDone) and is what the stream ends with.
    absl::MutexLock lock(&mu_);
    if (reading_ >= 0) {
      finish_at_half_close_ = true;
      committed_at_ = absl::Now();
      return;
    }
    message_after_commit = message_after_finish_;
  }
  Finish(message_after_commit ? MessageAfterCommitStatus() : ToGrpcStatus(status));
}

grpc::Status AppendReactor::MessageAfterCommitStatus() {
  return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                      "a message came on the Append stream after CommitAppend had committed it; that message was not "
                      "written (the commit of the messages CommitAppend named stands)");
}

void AppendReactor::OnDone() {
  if (registered_) service_->watchdog().Remove(this);
  if (append_ != nullptr && !append_->finished()) {
    // Every end of the stream rolls back on the worker before Finish; this is a bug.
    spdlog::error("Append {} ended with its transaction open; rolling it back on the pool's worker", Detail());
    pool_->worker().Post([append = std::move(append_)]() mutable { append->Abort(); });
  }
  delete this;
}

}  // namespace mlakv::server
