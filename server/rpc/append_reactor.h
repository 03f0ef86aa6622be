// AppendReactor: one Append stream (a raw method: ByteBuffer messages), a
// client-streaming call on the server's completion queue (cq/calls.h, which
// drives it the way gRPC's reactors are driven).
//
// The stream is one atomic append (AtomicAppend on the pool's worker). It
// commits only on a clean half-close after messages that all parsed and
// staged; every other end — a message that does not parse, one over the
// size limit, a transport error, a cancel, the deadline, an idle stream, a
// failure while staging — rolls everything back, and where the client can
// still hear it the status says which message failed and why
// (docs/reliability.md "Atomic streams").
//
// Why raw: gRPC's typed reader reports a message that fails to parse the
// same way as the end of the stream (a read that is not ok without an error
// on the call), so a truncated or non-UTF-8 second message would commit the
// first. Parsing here tells the two apart. A read that fails because the
// call broke (cancel, oversized message, lost connection, deadline) marks
// the call cancelled before OnReadDone(false) (gRPC's
// grpc_call_failed_before_recv_message), which ctx_.cancelled() then reports.
//
// Pipelining: two message slots. While the worker processes message k,
// message k+1 is received into the other slot, and the read of k+2 starts as
// soon as k's slot is free, so the server holds at most two messages per
// stream (backpressure) and the network overlaps the worker. The worker only
// stages and commits: while other tasks wait there, freeing a slot (its
// slices), the read that waited for it and Finish run on one of the
// service's transport executors (KvCacheService::NextTransport).
//
// CommitAppend: a stream whose first message named a commit_token can be
// committed by that unary call instead of its half-close (OpenAppends holds
// it by token; the commit goes behind the last message the call names). The
// call is answered in Done with the stream's own status and response; after
// such a commit the stream's Finish (OK) waits for the read in flight to end
// -- the client's half-close or cancel -- or for the idle timeout, so that
// the two answers do not reach the client at once.
//
// Lifetime: the object waits for its method's next request from the moment
// it is armed (OnStart when one came). Finish is called exactly once, and
// only when no task of this reactor is queued on a worker and no StartRead
// is being made; a read may still be in flight then (gRPC completes it with
// ok=false). OnDone removes the reactor from the watchdog and deletes it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mlakv/v1/kv_cache.pb.h"
#include "server/core/atomic_append.h"
#include "server/cq/calls.h"
#include "server/rpc/append_wire.h"
#include "server/rpc/kv_cache_service.h"
#include "server/regions/region_registry.h"
#include "server/rpc/stream_watchdog.h"

namespace mlakv::server {

class AppendReactor final : public cq::ReaderCall<grpc::ByteBuffer, grpc::ByteBuffer>,
                            public StreamWatchdog::Watched {
 public:
  // Serves Append on `queue` from now on.
  static void Serve(KvCacheService* service, cq::QueueThreads* queue) { Arm(new AppendReactor(service, queue)); }

  void OnWatchdogTick(absl::Time now) override;

  // ---- CommitAppend (a stream whose first message named a commit_token) ----
  // `call` asks to commit this stream after its first `messages` messages;
  // it is answered when the stream ends (Done), with the stream's own
  // status and response. Called by OpenAppends::Take, under the registry's
  // mutex (the stream cannot end meanwhile). True when the commit is due
  // now: the caller then calls StartCommit once it has let go of the
  // registry (the commit may run in place). Otherwise the last of those
  // messages starts it when it comes, or the stream's end answers the call.
  bool OnCommitRequested(CommitAppendCall* call, uint32_t messages, KvCacheService::RpcScope scope);
  void StartCommit();

 private:
  AppendReactor(KvCacheService* service, cq::QueueThreads* queue) : ReaderCall(queue), service_(service) {}

  void Request(void* tag) override;
  Call* NextCall() override { return new AppendReactor(service_, queue_); }
  void OnStart() override;
  void OnReadDone(bool ok) override;
  void OnDone() override;

  struct Slot {
    grpc::ByteBuffer raw;      // what the read delivers
    ReceivedAppend received;   // parsed from raw, the rows left in its slices (server/rpc/append_wire.h)
    size_t raw_bytes = 0;      // the message's size on the wire
    bool busy = false;         // holds a message queued on / being processed by the worker
  };

  // ---- reader side (gRPC threads) ----
  void OnMessage(int slot, int index);
  void OnStreamEnd();
  // The slot to read the next message into, marked as being read; -1 when
  // both hold messages not yet processed (the worker starts the read when
  // it frees one). Never called with a read in flight.
  int TakeFreeSlotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Called without mu_ (the read may complete, and OnReadDone run, before
  // StartRead returns).
  void StartReadInto(int slot);
  // The stream failed with `status`: a rollback task goes to the worker
  // (the pool's, or the service's control executor before any message named
  // a pool); later messages are ignored.
  void FailLocked(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The first message's commit_token, into the service's OpenAppends.
  absl::Status RegisterCommitToken(const std::string& token);
  // CommitAppend's commit is due: its call came and every message it named
  // is posted to the worker. Marks the commit started (the caller posts it).
  bool TakeDueCommitLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the commit task started and counted in queued_.
  void StartCommitLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers the CommitAppend call, if one waits, with the stream's end.
  void AnswerCommitCall(const absl::Status& status);

  // ---- worker side ----
  // Stages the slot's message, then Release (OffWorker).
  void Process(int slot, int index);
  // Frees the slot (its slices go back), starts the read that waited for
  // it, finishes when that was the last task.
  void Release(int slot);
  absl::Status ProcessMessage(const ReceivedAppend& received, int index);
  // Once the held writes name every layer of the pool (a layer-wise save's
  // last group has come), writes them as soon as their producers' events
  // have completed -- not at the half-close, which then finds only the
  // commit left: the launch overlaps the client's end of the stream. Called
  // in a message's task (Process), whose count in queued_ keeps the stream
  // from finishing while WriteHeldEarly runs inline.
  void WriteEveryLayerWhenReady();
  void WriteHeldEarly(absl::Status waited);
  // A worker task's wait for the held rows' `events`: spent here while
  // nothing else is queued on the worker -- true once they have completed,
  // so the task goes on at once -- else handed to the pool's SourceWaiter,
  // whose end posts `then` to the worker with its status: false, the task
  // returns. The status of a wait that ended here otherwise.
  absl::StatusOr<bool> WaitHereOrHandOver(std::vector<const void*> events, WaitLimits limits,
                                          absl::AnyInvocable<void(absl::Status) &&> then);
  // The commit on a clean end (`waited`: how the wait for the held rows'
  // events ended, OK when there was none).
  void Complete(absl::Status waited);
  absl::Status CommitStream();
  void Fail(const absl::Status& status);

  // The status to finish with, once: when the stream is finishing, no task of
  // this reactor is left on a worker and no StartRead is about to be made.
  std::optional<absl::Status> TakeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Done(const absl::Status& status);
  // How a stream committed by CommitAppend ends when a message comes after it.
  static grpc::Status MessageAfterCommitStatus();
  // Done, from a worker task: off the worker when it has more to do.
  void FinishOffWorker(absl::Status status);
  // Runs `step` (the transport's side of a worker task) on the stream's
  // transport executor when other tasks wait on the pool's worker, else
  // here at once.
  void OffWorker(absl::AnyInvocable<void() &&> step);
  std::string Detail() const;

  KvCacheService* const service_;
  // Set by OnStart.
  SerialExecutor* transport_ = nullptr;  // the service's, for this stream's life (KvCacheService::NextTransport)
  absl::Time started_;
  bool counted_ = false;     // in the service's appends in flight (not when refused while draining)
  bool registered_ = false;  // with the watchdog

  Slot slots_[2];
  absl::Mutex mu_;
  int reading_ ABSL_GUARDED_BY(mu_) = -1;        // slot a read is in flight into, -1: none
  bool read_wanted_ ABSL_GUARDED_BY(mu_) = false;  // a read waits for a free slot
  int queued_ ABSL_GUARDED_BY(mu_) = 0;           // tasks of this reactor on a worker
  int starting_reads_ ABSL_GUARDED_BY(mu_) = 0;   // reads decided on, StartRead not yet returned
  bool doomed_ ABSL_GUARDED_BY(mu_) = false;      // a failure is known; its rollback task is queued
  absl::Status doom_status_ ABSL_GUARDED_BY(mu_);  // that failure (a commit that comes first reports it)
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_taken_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status finish_status_ ABSL_GUARDED_BY(mu_);
  absl::Time last_activity_ ABSL_GUARDED_BY(mu_);  // last message received or processed
  int messages_received_ ABSL_GUARDED_BY(mu_) = 0;
  // Set by the first message, before any task is posted; read-only after.
  Pool* pool_ = nullptr;
  std::string pool_field_;
  std::string sequence_;
  v1::SequenceView view_ = v1::SEQUENCE_VIEW_FULL;
  // Worker-only state.
  std::unique_ptr<AtomicAppend> append_;
  bool sources_waited_ = false;  // the held rows' events were waited for (or found complete)
  bool early_write_pending_ = false;  // WriteHeldEarly is waited for or queued
  bool wrote_early_ = false;          // held rows were written before the stream's end (read in Done, after mu_)
  // The commit has begun (its waits are over) or the stream failed: a wait
  // for an early write is given up (the commit, or the rollback, takes
  // over). Read by the SourceWaiter's thread.
  std::atomic<bool> ending_{false};
  // Where the end of a clean stream spends its time (logged with the call at
  // debug level): the half-close read, its commit task started on the
  // worker, the producers' events complete, the held rows written and the
  // commit done. Written by the thread that reads the half-close, then by the
  // commit task (posted after it), then read in Done (after that task).
  struct EndTimes {
    std::chrono::steady_clock::time_point closed, task, sources, committed;
    bool by_call = false;  // the commit was CommitAppend's (`closed`: when its last message was posted)
  } end_;
  // Regions the stream's messages named: held until the stream ends, so an
  // UnregisterRegion meanwhile never unmaps memory this append reads.
  RegionHold regions_held_;
  uint64_t row_bytes_ = 0;  // ckv + kpe bytes of the rows staged
  std::atomic<int> messages_processed_{0};
  // CommitAppend. The token and whether this stream holds it in the
  // service's OpenAppends: set by the first message's read, before any task
  // is posted; read-only after (Done removes the token).
  std::string commit_token_;
  bool token_registered_ = false;
  // The CommitAppend call waiting for this stream's end, and what it named.
  CommitAppendCall* commit_call_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::optional<KvCacheService::RpcScope> commit_scope_ ABSL_GUARDED_BY(mu_);
  int commit_after_ ABSL_GUARDED_BY(mu_) = 0;
  // Messages whose Process task is posted (the commit goes behind the last).
  int messages_posted_ ABSL_GUARDED_BY(mu_) = 0;
  // The commit task is queued -- by a clean half-close or by CommitAppend;
  // the other then adds nothing.
  bool commit_started_ ABSL_GUARDED_BY(mu_) = false;
  // Committed by CommitAppend: Done leaves the stream's Finish (OK) to the
  // end of the read in flight -- the client's half-close -- or to the
  // watchdog, append_idle_timeout after `committed_at_`.
  bool finish_at_half_close_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time committed_at_ ABSL_GUARDED_BY(mu_);
  // A message was read (and dropped) after the stream began finishing, or
  // after its commit by CommitAppend became certain.
  bool message_after_finish_ ABSL_GUARDED_BY(mu_) = false;
  // The commit passed its last check (CommitStream): it lands whatever is
  // read from now on, so nothing may doom the stream any more.
  bool commit_certain_ ABSL_GUARDED_BY(mu_) = false;
  // CommitAppend's answer when it differs from the stream's: a count that
  // came too late to roll back the half-close's commit.
  std::optional<absl::Status> commit_call_status_ ABSL_GUARDED_BY(mu_);
  // The committed response, for the CommitAppend call (written by the
  // commit task, read in Done after it).
  v1::AppendResponse committed_;
};

}  // namespace mlakv::server
