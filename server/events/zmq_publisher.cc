#include "server/events/zmq_publisher.h"

#include <algorithm>
#include <array>
#include <deque>
#include <memory>
#include <utility>
#include <vector>

#define MSGPACK_NO_BOOST
#include <msgpack.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/tsan_annotations.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {
namespace {

std::string SeqBytes(int64_t seq) {
  std::string out(8, '\0');
  const uint64_t u = static_cast<uint64_t>(seq);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((u >> (56 - 8 * i)) & 0xFF);
  return out;
}

// An 8-byte big-endian batch number (the caller checks the size).
int64_t SeqFromBytes(const zmq::message_t& m) {
  uint64_t u = 0;
  for (size_t i = 0; i < 8; ++i) u = (u << 8) | static_cast<const uint8_t*>(m.data())[i];
  return static_cast<int64_t>(u);
}

void PackBytes(msgpack::packer<msgpack::sbuffer>& pk, const std::string& b) {
  pk.pack_bin(static_cast<uint32_t>(b.size()));
  pk.pack_bin_body(b.data(), static_cast<uint32_t>(b.size()));
}

// The client's hashes of the event's pages, the empty ones left out.
std::vector<const std::string*> Hashes(const KvEvent& e) {
  std::vector<const std::string*> out;
  for (const std::string& h : e.block_hashes) {
    if (!h.empty()) out.push_back(&h);
  }
  return out;
}

// A batch's encoded bytes, shared by the kept batches and the messages
// ZeroMQ has queued: a replay or a publish sends them without a copy, and a
// batch that leaves the kept ones lives on until its last queued message is
// sent.
using Payload = std::shared_ptr<const std::string>;

// A message whose bytes are the payload's own, held until ZeroMQ frees it
// (on its I/O thread: the hold is a shared_ptr, counted atomically; the
// hand-over of the message is inside libzmq, told to TSan here).
zmq::message_t SharedMessage(const Payload& payload) {
  auto* hold = new Payload(payload);
  zmq::message_t message(
      const_cast<char*>((*hold)->data()), (*hold)->size(),
      [](void*, void* hint) {
        MLAKV_TSAN_HAPPENS_AFTER(hint);
        delete static_cast<Payload*>(hint);
      },
      hold);
  // After this thread's last touch of `hold` (the reads above), before the
  // send hands the message to ZeroMQ's I/O thread.
  MLAKV_TSAN_HAPPENS_BEFORE(hold);
  return message;
}

// Sends the small frames (copied) and then the payload as one message.
// False if the first frame could not be queued, and then nothing was: once
// a message's first frame is in, ZeroMQ takes the rest of it.
template <size_t N>
bool SendWithPayload(zmq::socket_t& socket, const std::array<zmq::const_buffer, N>& frames, const Payload& payload) {
  for (size_t i = 0; i < N; ++i) {
    if (!socket.send(frames[i], zmq::send_flags::dontwait | zmq::send_flags::sndmore)) return false;
  }
  zmq::message_t last = SharedMessage(payload);
  return socket.send(last, zmq::send_flags::dontwait).has_value();
}

// The end marker's empty payload.
const Payload& EmptyPayload() {
  static const Payload* empty = new Payload(std::make_shared<const std::string>());
  return *empty;
}

}  // namespace

struct ZmqEventPublisher::Sockets {
  zmq::context_t context{1};
  zmq::socket_t pub{context, zmq::socket_type::pub};
  zmq::socket_t replay{context, zmq::socket_type::router};
  bool has_replay = false;
};

// The batches kept for replay: numbers without gaps, oldest first.
struct ZmqEventPublisher::Kept {
  std::deque<std::pair<int64_t, Payload>> batches;
  size_t bytes = 0;  // of the payloads

  int64_t first() const { return batches.empty() ? 0 : batches.front().first; }
  int64_t end() const { return first() + static_cast<int64_t>(batches.size()); }  // the newest + 1
  const Payload& payload(int64_t seq) const { return batches[static_cast<size_t>(seq - first())].second; }

  // Keeps one more; drops the oldest past either bound (never the newest).
  void Add(int64_t seq, Payload payload, size_t max_batches, size_t max_bytes) {
    bytes += payload->size();
    batches.emplace_back(seq, std::move(payload));
    while (batches.size() > 1 && (batches.size() > max_batches || bytes > max_bytes)) {
      bytes -= batches.front().second->size();
      batches.pop_front();
    }
  }
};

// One replay in progress: whom, and what it gets next (kept.end(): the end marker).
struct ZmqEventPublisher::Replay {
  std::string client;  // the ROUTER's id of the peer
  int64_t next = 0;
  absl::Time progress;  // when its peer last took a message (or asked)
};

std::string ZmqEventPublisher::EncodeBatch(const std::vector<KvEvent>& events,
                                           const std::map<std::string, std::string>& medium, double ts) {
  // What is sent: the events that say something to a router.
  std::vector<const KvEvent*> sent;
  for (const KvEvent& e : events) {
    if (e.kind == KvEvent::Kind::kCleared || !Hashes(e).empty()) sent.push_back(&e);
  }
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_array(2);  // KVEventBatch: ts, events (data_parallel_rank: default, omitted)
  pk.pack_double(ts);
  pk.pack_array(static_cast<uint32_t>(sent.size()));
  for (const KvEvent* e : sent) {
    const auto m = medium.find(e->pool);
    const std::string med = m == medium.end() ? "GPU" : m->second;
    if (e->kind == KvEvent::Kind::kCleared) {
      pk.pack_array(1);
      pk.pack(std::string("AllBlocksCleared"));
      continue;
    }
    const std::vector<const std::string*> hashes = Hashes(*e);
    if (e->kind == KvEvent::Kind::kStored) {
      pk.pack_array(7);
      pk.pack(std::string("BlockStored"));
      pk.pack_array(static_cast<uint32_t>(hashes.size()));
      for (const std::string* h : hashes) PackBytes(pk, *h);
      if (e->parent_block_hash.empty()) {
        pk.pack_nil();
      } else {
        PackBytes(pk, e->parent_block_hash);
      }
      pk.pack_array(0);  // token ids: the server never sees tokens
      pk.pack(e->page_size);
      pk.pack_nil();  // lora id
      pk.pack(med);
    } else {
      pk.pack_array(3);
      pk.pack(std::string("BlockRemoved"));
      pk.pack_array(static_cast<uint32_t>(hashes.size()));
      for (const std::string* h : hashes) PackBytes(pk, *h);
      pk.pack(med);
    }
  }
  return std::string(buf.data(), buf.size());
}

ZmqEventPublisher::ZmqEventPublisher(Options options, EventLog* log)
    : options_(std::move(options)), log_(log), sockets_(std::make_unique<Sockets>()) {}

absl::StatusOr<std::unique_ptr<ZmqEventPublisher>> ZmqEventPublisher::Start(Options options, EventLog* log) {
  std::unique_ptr<ZmqEventPublisher> p(new ZmqEventPublisher(std::move(options), log));
  Sockets& s = *p->sockets_;
  try {
    s.pub.set(zmq::sockopt::linger, 0);
    // A subscriber slower than the batches holds at most this many queued
    // (the payloads shared with the kept ones); past it PUB drops for it.
    s.pub.set(zmq::sockopt::sndhwm, p->options_.send_queue);
    s.pub.bind(p->options_.endpoint);
    p->bound_endpoint_ = s.pub.get(zmq::sockopt::last_endpoint);
  } catch (const zmq::error_t& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_events_endpoint ", p->options_.endpoint, ": cannot bind (", e.what(), ")"));
  }
  if (!p->options_.replay_endpoint.empty()) {
    try {
      s.replay.set(zmq::sockopt::linger, 0);
      // A full queue to a peer answers EAGAIN (and a gone peer
      // EHOSTUNREACH) instead of dropping the message unsaid.
      s.replay.set(zmq::sockopt::router_mandatory, 1);
      s.replay.set(zmq::sockopt::sndhwm, p->options_.replay_queue);
      s.replay.set(zmq::sockopt::maxmsgsize, int64_t{256});  // a request's frames are 0 and 8 bytes
      s.replay.bind(p->options_.replay_endpoint);
      p->bound_replay_endpoint_ = s.replay.get(zmq::sockopt::last_endpoint);
      s.has_replay = true;
    } catch (const zmq::error_t& e) {
      return absl::InvalidArgumentError(absl::StrCat("--kv_events_replay_endpoint ", p->options_.replay_endpoint,
                                                     ": cannot bind (", e.what(), ")"));
    }
  }
  p->thread_ = std::thread([raw = p.get()] { raw->Run(); });
  return p;
}

ZmqEventPublisher::~ZmqEventPublisher() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

void ZmqEventPublisher::AcceptReplayRequests(std::vector<Replay>& replays) {
  Sockets& s = *sockets_;
  while (true) {
    // Frame by frame, keeping the three a request has: maxmsgsize bounds
    // each frame, not how many a message has, and a request of millions of
    // frames read whole (recv_multipart) took ~1 GB at once.
    std::array<zmq::message_t, 3> request;
    size_t frames = 0;
    zmq::message_t part;
    if (!s.replay.recv(part, zmq::recv_flags::dontwait)) return;
    while (true) {
      const bool more = part.more();
      if (frames < request.size()) request[frames] = std::move(part);
      ++frames;
      if (!more) break;
      part.rebuild();
      (void)s.replay.recv(part, zmq::recv_flags::none);  // a message's frames arrive together
    }
    // Not [client, "", start (8 bytes)]: ignored, unanswered.
    if (frames != 3 || !request[1].empty() || request[2].size() != 8) continue;
    Replay r{.client = request[0].to_string(), .next = SeqFromBytes(request[2]), .progress = absl::Now()};
    const auto same = std::find_if(replays.begin(), replays.end(), [&](const Replay& o) { return o.client == r.client; });
    if (same != replays.end()) {
      *same = std::move(r);  // asked again: starts over
    } else if (replays.size() < options_.max_replays) {
      replays.push_back(std::move(r));
    } else {
      replays_dropped_.fetch_add(1);
      spdlog::warn("kv events replay: {} replays in progress already; a request is dropped (the client asks again)",
                   replays.size());
    }
  }
}

bool ZmqEventPublisher::AdvanceReplays(const Kept& kept, std::vector<Replay>& replays, int budget) {
  Sockets& s = *sockets_;
  const absl::Time now = absl::Now();
  bool any = false;
  for (auto it = replays.begin(); it != replays.end();) {
    Replay& r = *it;
    bool over = false, took = false;
    for (int n = 0; n < budget && !over; ++n) {
      r.next = std::max(r.next, kept.first());  // what left the kept ones is skipped
      const bool marker = r.next >= kept.end();
      const std::string seq_bytes = SeqBytes(marker ? -1 : r.next);
      const std::array<zmq::const_buffer, 3> frames = {zmq::buffer(r.client), zmq::str_buffer(""),
                                                       zmq::buffer(seq_bytes)};
      bool sent = false;
      try {
        sent = SendWithPayload(s.replay, frames, marker ? EmptyPayload() : kept.payload(r.next));
      } catch (const zmq::error_t&) {  // EHOSTUNREACH: the peer is gone
        replays_abandoned_.fetch_add(1);
        over = true;
        break;
      }
      if (!sent) break;  // its queue is full: the rest later
      any = took = true;
      if (marker) {
        replays_done_.fetch_add(1);
        over = true;
      } else {
        ++r.next;
      }
    }
    if (took) {
      r.progress = now;
    } else if (!over && now - r.progress > options_.replay_stall) {
      spdlog::warn("kv events replay: a peer took nothing for {}; its replay ends at batch {}",
                   absl::FormatDuration(options_.replay_stall), r.next);
      replays_abandoned_.fetch_add(1);
      over = true;
    }
    it = over ? replays.erase(it) : it + 1;
  }
  return any;
}

EventPublisherStats ZmqEventPublisher::stats() const {
  return {.batches = sent_.load(),
          .replays_done = replays_done_.load(),
          .replays_abandoned = replays_abandoned_.load(),
          .replays_dropped = replays_dropped_.load(),
          .replays_active = replays_active_.load()};
}

void ZmqEventPublisher::Run() {
  Sockets& s = *sockets_;
  Kept kept;
  std::vector<Replay> replays;
  int64_t next_seq = 0;
  uint64_t cursor = std::max<uint64_t>(1, log_->oldest());
  std::vector<KvEvent> events;
  while (!stop_.load()) {
    // Replays first, a few batches each a turn, so that publishing goes on.
    bool replayed = false;
    if (s.has_replay) {
      AcceptReplayRequests(replays);
      replayed = AdvanceReplays(kept, replays, 64);
      replays_active_.store(static_cast<int64_t>(replays.size()));
    }
    // Wait for events unless a replay can go on now; a replay waiting for
    // its peer to read is looked at again every 2 ms.
    const absl::Duration wait =
        replays.empty() ? absl::Milliseconds(20) : (replayed ? absl::ZeroDuration() : absl::Milliseconds(2));
    events.clear();
    // Up to 512 events and ~1 MiB of them a batch (one larger event alone).
    const absl::Status read = log_->Read(cursor, 512, wait, &events, size_t{1} << 20);
    if (absl::IsUnavailable(read)) break;  // the server is shutting down
    if (absl::IsOutOfRange(read)) {
      // Fell behind the log's ring (it should not: this thread only
      // encodes). The missed events are gone; say so and go on from the oldest.
      spdlog::warn("kv events publisher fell behind: {}", std::string(read.message()));
      cursor = log_->oldest();
      continue;
    }
    if (events.empty()) continue;
    cursor = events.back().number + 1;
    Payload payload = std::make_shared<const std::string>(
        EncodeBatch(events, options_.medium_of_pool, absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch())));
    const int64_t seq = next_seq++;
    const std::string seq_bytes = SeqBytes(seq);
    const std::array<zmq::const_buffer, 2> frames = {zmq::buffer(options_.topic), zmq::buffer(seq_bytes)};
    SendWithPayload(s.pub, frames, payload);  // a PUB socket drops for a slow subscriber, never blocks
    kept.Add(seq, std::move(payload), options_.replay_batches, options_.replay_bytes);
    sent_.fetch_add(1);
  }
}

}  // namespace mlakv::server
