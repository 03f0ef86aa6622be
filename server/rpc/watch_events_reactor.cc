#include "server/rpc/watch_events_reactor.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "server/rpc/call_support.h"
#include "server/rpc/grpc_status.h"
#include "server/rpc/kv_cache_service.h"

namespace mlakv::server {
namespace {

constexpr uint32_t kDefaultBatch = 256;
constexpr uint32_t kMaxBatch = 4096;
constexpr absl::Duration kPoll = absl::Milliseconds(200);
// A response's events stop short of this many bytes (one larger event goes
// alone): an event lists every page it stored or freed, and 256 events of
// long hashed sequences would make a response of tens of MB -- past a
// client's default 4 MB receive limit (gRPC's, grpcurl's), and past the
// server's send limit at worst, where the watcher would fail at the same
// event every time it resumed. The read from the log stops at as many
// bytes of events (their memory, a little over their wire size), so a
// watcher's copy is bounded too: 4,096 events of a freed 262k-token
// sequence would be ~1.8 GB.
constexpr size_t kMaxResponseBytes = size_t{1} << 20;

}  // namespace

void WatchEventsReactor::ToProto(const KvEvent& e, v1::KvEvent* out) {
  out->set_number(e.number);
  out->set_time_unix_nanos(e.time_unix_ns);
  out->set_pool(e.pool);
  switch (e.kind) {
    case KvEvent::Kind::kStored: {
      v1::PagesStored* s = out->mutable_stored();
      s->set_sequence(e.sequence);
      s->set_first_page_index(e.first_page_index);
      for (int32_t p : e.pages) s->add_pages(static_cast<uint32_t>(p));
      for (const std::string& h : e.block_hashes) s->add_block_hashes(h);
      s->set_page_size(e.page_size);
      break;
    }
    case KvEvent::Kind::kRemoved: {
      v1::PagesRemoved* r = out->mutable_removed();
      r->set_sequence(e.sequence);
      for (int32_t p : e.pages) r->add_pages(static_cast<uint32_t>(p));
      for (const std::string& h : e.block_hashes) r->add_block_hashes(h);
      r->set_reason(e.reason);
      break;
    }
    case KvEvent::Kind::kCleared:
      out->mutable_cleared();
      break;
  }
}

void WatchEventsReactor::Request(void* tag) {
  grpc::ServerCompletionQueue* queue = queue_->queue();
  service_->async()->RequestWatchEvents(&ctx_, request(), writer(), queue, queue, tag);
}

void WatchEventsReactor::OnStart() {
  const v1::WatchEventsRequest* req = request();
  const absl::Status refused = service_->WatcherStarted();
  log_ = service_->options().events;
  if (!refused.ok()) {
    LogCall("WatchEvents", absl::StrCat("from=", req->from()), refused);
    Finish(ToGrpcStatus(refused));
    return;
  }
  const uint64_t next = log_->next();
  uint64_t from = req->from() == 0 ? next : req->from();
  const uint32_t max_batch = req->max_batch() == 0 ? kDefaultBatch : std::min(req->max_batch(), kMaxBatch);
  if (from > next) {
    LogCall("WatchEvents", absl::StrCat("from=", req->from()), absl::OutOfRangeError(""));
    Finish(ToGrpcStatus(absl::OutOfRangeError(absl::StrCat(
        "event ", from, " has not happened: this server's events so far are ", log_->oldest(), "..", next - 1,
        " (numbers restart at 1 when a server restarts; its event 1 is \"all cleared\": resynchronize)"))));
    return;
  }
  std::thread([this, from, max_batch] { Run(from, max_batch); }).detach();
}

void WatchEventsReactor::Run(uint64_t from, uint32_t max_batch) {
  std::shared_ptr<State> state = state_;  // the reactor may go once Finish is called
  absl::Status status;
  uint64_t cursor = from;
  bool started = false;
  std::vector<KvEvent> events;
  // What ends the stream before the next read: a cancel, or a write that failed.
  const auto ended = [&]() -> bool {
    absl::MutexLock lock(&state->mu);
    if (state->cancelled) {
      status = absl::CancelledError("the watcher cancelled the stream");
    } else if (state->write_failed) {
      status = absl::UnavailableError("the stream broke while an event batch was written");
    }
    return !status.ok();
  };
  while (!ended()) {
    events.clear();
    absl::Status read = log_->Read(cursor, max_batch, kPoll, &events, kMaxResponseBytes);
    if (!read.ok()) {
      if (absl::IsOutOfRange(read) && started) {
        status = absl::ResourceExhaustedError(absl::StrCat(
            "this watcher fell behind: event ", cursor, " left the server's replay buffer (", log_->capacity(),
            " events, at most ", log_->replay_bytes(), " bytes) before it was sent; events were not slowed for it. "
            "Resume with from=", log_->oldest(), " after resynchronizing, and read faster"));
      } else {
        status = read;
      }
      break;
    }
    started = true;
    // The events read, as responses of at most kMaxResponseBytes each (one
    // event more than that goes alone).
    for (size_t next = 0; next < events.size() && !ended();) {
      const size_t first = next;
      next = FillResponse(events, next);
      if (const size_t bytes = response_.ByteSizeLong(); bytes > service_->options().max_message_bytes) {
        // One event alone (a long sequence's pages and hashes) over the send
        // limit: every resume would fail at it the same way.
        status = absl::ResourceExhaustedError(absl::StrCat(
            "event ", events[first].number, " takes ", bytes, " bytes in a response, over this server's ",
            "max_message_bytes of ", service_->options().max_message_bytes,
            "; raise max_message_bytes, or resume with from=", events[first].number + 1, " to skip it"));
        break;  // ended() sees the status
      }
      cursor = events[next - 1].number + 1;
      {
        absl::MutexLock lock(&state->mu);
        if (state->cancelled) continue;  // ended() finishes it
        state->writing = true;
      }
      StartWrite(&response_);
      absl::MutexLock lock(&state->mu);
      state->mu.Await(absl::Condition(
          +[](State* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return !s->writing; }, state.get()));
    }
  }
  LogCall("WatchEvents", absl::StrCat("from=", from, " reached=", cursor), status);
  Finish(ToGrpcStatus(status));  // the last touch of the reactor
}

size_t WatchEventsReactor::FillResponse(const std::vector<KvEvent>& events, size_t first) {
  response_.Clear();
  response_.set_server_id(service_->options().server_id);
  // Within the server's own send limit too (a server configured below 1 MiB
  // failed every batch over it, at the same event on every resume).
  const size_t limit = std::min<size_t>(kMaxResponseBytes, service_->options().max_message_bytes);
  size_t bytes = response_.ByteSizeLong();
  size_t i = first;
  for (; i < events.size(); ++i) {
    v1::KvEvent* out = response_.add_events();
    ToProto(events[i], out);
    bytes += out->ByteSizeLong() + 8;  // the field's tag and length
    if (bytes > limit && i > first) {
      response_.mutable_events()->RemoveLast();  // it goes first in the next response
      break;
    }
  }
  return i;
}

void WatchEventsReactor::OnWriteDone(bool ok) {
  absl::MutexLock lock(&state_->mu);
  state_->writing = false;
  if (!ok) state_->write_failed = true;
}

void WatchEventsReactor::OnCancel() {
  absl::MutexLock lock(&state_->mu);
  state_->cancelled = true;
}

void WatchEventsReactor::OnDone() {
  service_->WatcherEnded();
  delete this;
}

}  // namespace mlakv::server
