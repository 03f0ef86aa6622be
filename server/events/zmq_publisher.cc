#include "server/events/zmq_publisher.h"

#include <deque>
#include <utility>
#include <vector>

#define MSGPACK_NO_BOOST
#include <msgpack.hpp>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {
namespace {

std::string SeqBytes(int64_t seq) {
  std::string out(8, '\0');
  const uint64_t u = static_cast<uint64_t>(seq);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((u >> (56 - 8 * i)) & 0xFF);
  return out;
}

int64_t SeqFromBytes(const zmq::message_t& m) {
  if (m.size() != 8) return -1;
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

}  // namespace

struct ZmqEventPublisher::Sockets {
  zmq::context_t context{1};
  zmq::socket_t pub{context, zmq::socket_type::pub};
  zmq::socket_t replay{context, zmq::socket_type::router};
  bool has_replay = false;
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
    s.pub.bind(p->options_.endpoint);
  } catch (const zmq::error_t& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_events_endpoint ", p->options_.endpoint, ": cannot bind (", e.what(), ")"));
  }
  if (!p->options_.replay_endpoint.empty()) {
    try {
      s.replay.set(zmq::sockopt::linger, 0);
      s.replay.bind(p->options_.replay_endpoint);
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

void ZmqEventPublisher::Run() {
  Sockets& s = *sockets_;
  std::deque<std::pair<int64_t, std::string>> kept;  // (seq, payload) for replay
  size_t kept_bytes = 0;                                // of the payloads in `kept`
  int64_t next_seq = 0;
  uint64_t cursor = std::max<uint64_t>(1, log_->oldest());
  std::vector<KvEvent> events;
  while (!stop_.load()) {
    // Replay requests first: they are answered from what was sent.
    while (s.has_replay) {
      std::vector<zmq::message_t> request;
      const auto got = zmq::recv_multipart(s.replay, std::back_inserter(request), zmq::recv_flags::dontwait);
      if (!got) break;
      if (request.size() != 3) continue;  // not [client, "", start]
      const int64_t start = SeqFromBytes(request[2]);
      const std::string client = request[0].to_string();
      for (const auto& [seq, payload] : kept) {
        if (seq < start) continue;
        const std::string seq_bytes = SeqBytes(seq);  // named: the buffers below only point at it
        std::array<zmq::const_buffer, 4> reply = {zmq::buffer(client), zmq::str_buffer(""), zmq::buffer(seq_bytes),
                                                  zmq::buffer(payload)};
        zmq::send_multipart(s.replay, reply);
      }
      const std::string end = SeqBytes(-1);
      std::array<zmq::const_buffer, 4> done = {zmq::buffer(client), zmq::str_buffer(""), zmq::buffer(end),
                                               zmq::str_buffer("")};
      zmq::send_multipart(s.replay, done);
    }
    events.clear();
    // Up to 512 events and ~1 MiB of them a batch (one larger event alone).
    const absl::Status read = log_->Read(cursor, 512, absl::Milliseconds(20), &events, size_t{1} << 20);
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
    std::string payload = EncodeBatch(events, options_.medium_of_pool, absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
    const int64_t seq = next_seq++;
    const std::string seq_bytes = SeqBytes(seq);
    std::array<zmq::const_buffer, 3> message = {zmq::buffer(options_.topic), zmq::buffer(seq_bytes),
                                                zmq::buffer(payload)};
    zmq::send_multipart(s.pub, message, zmq::send_flags::dontwait);  // a PUB socket drops for a slow subscriber
    kept_bytes += payload.size();
    kept.emplace_back(seq, std::move(payload));
    while (kept.size() > 1 && (kept.size() > options_.replay_batches || kept_bytes > options_.replay_bytes)) {
      kept_bytes -= kept.front().second.size();
      kept.pop_front();
    }
    sent_.fetch_add(1);
  }
}

}  // namespace mlakv::server
