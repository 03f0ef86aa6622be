// ZmqEventPublisher: the server's KV events (server/core/kv_events.h) on
// ZeroMQ in the wire format of vLLM's ZmqEventPublisher, so KV-aware routers
// built for vLLM (and Mooncake, which publishes the same) can follow an
// mlakv fleet unchanged (docs/events.md "vLLM's format").
//
// One thread follows the EventLog and publishes each read as one batch:
//   PUB socket (endpoint):       multipart [topic, seq (8 bytes, big-endian), payload]
//   ROUTER socket (replay):      a request [client, "", start_seq (8 bytes)] is answered
//                                with [client, "", seq, payload] for every kept batch
//                                numbered >= start_seq, then [client, "", -1 (8 bytes), ""];
//                                the last replay_batches batches are kept, and no more
//                                than replay_bytes of payload (a batch of 512 events of
//                                long hashed sequences can be megabytes)
//
// A replay is sent in steps, never more than the peer's send queue takes
// (replay_queue messages): a ROUTER socket drops what it cannot queue, and a
// replay of thousands of batches sent in one go would lose its middle and its
// end marker for any peer slower than this thread. Each replay in progress
// holds only its client's id and the next number to send; at most
// max_replays are in progress (a request past that is dropped, with a
// warning: the client times out and asks again); a client that asks again
// restarts its replay; one that disconnects ends it, and so does one that
// takes nothing for replay_stall (its slot goes to others). A batch that leaves the
// kept ones while its replay waits is skipped (the client sees the gap in the
// numbers, as when it asks for a batch older than the oldest kept).
// payload: msgpack of vLLM's KVEventBatch, array-like (msgspec's encoding):
//   [ts: float seconds, [event, ...]]
//   event: ["BlockStored", [hash, ...], parent_hash | nil, [] (token ids), block_size, nil (lora id), medium]
//        | ["BlockRemoved", [hash, ...], medium]
//        | ["AllBlocksCleared"]
// Hashes are the clients' block hashes, as bytes; pages without one are
// left out (a router keys blocks by hash), and an event left with none is
// not sent. medium: "GPU" for a cuda pool, "CPU" for a cpu pool.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/core/kv_events.h"

namespace mlakv::server {

class ZmqEventPublisher {
 public:
  struct Options {
    std::string endpoint{};         // PUB, e.g. tcp://*:5557
    std::string replay_endpoint{};  // ROUTER, e.g. tcp://*:5558; empty: no replay
    std::string topic{};            // first frame of every message; "" as vLLM's default
    size_t replay_batches = 10000;            // batches kept for replay,
    size_t replay_bytes = size_t{64} << 20;  // and at most this many payload bytes (the newest always kept)
    size_t max_replays = 16;                 // replays in progress at once
    int replay_queue = 16;                   // messages queued to one replay peer (ZMQ_SNDHWM): each up to ~1 MiB
    int send_queue = 1000;                   // batches queued to one PUB subscriber (ZMQ_SNDHWM); then dropped for it
    absl::Duration replay_stall = absl::Seconds(10);  // a replay whose peer takes nothing this long ends
    std::map<std::string, std::string> medium_of_pool{};  // pool -> "GPU" / "CPU"
  };

  // Binds the sockets (an endpoint that cannot be bound: INVALID_ARGUMENT
  // naming it) and starts publishing from the log's oldest event. A tcp
  // endpoint's port may be * (ZeroMQ picks a free one): bound_endpoint()
  // and bound_replay_endpoint() say which.
  static absl::StatusOr<std::unique_ptr<ZmqEventPublisher>> Start(Options options, EventLog* log);
  ~ZmqEventPublisher();  // stops the thread; unsent events are dropped

  // The vLLM encoding of one batch (what the PUB socket sends as payload).
  static std::string EncodeBatch(const std::vector<KvEvent>& events, const std::map<std::string, std::string>& medium,
                                 double ts);
  // What it has done, for metrics (mlakv_kv_events_zmq_*) and tests:
  // replays abandoned are those whose peer left or took nothing for
  // replay_stall; dropped, those asked while max_replays were under way.
  EventPublisherStats stats() const;
  // What the sockets are bound to (ZMQ_LAST_ENDPOINT), e.g. tcp://127.0.0.1:41234; "" without replay.
  const std::string& bound_endpoint() const { return bound_endpoint_; }
  const std::string& bound_replay_endpoint() const { return bound_replay_endpoint_; }

 private:
  struct Sockets;
  struct Kept;
  struct Replay;
  ZmqEventPublisher(Options options, EventLog* log);
  void Run();
  // Takes the replay requests waiting on the socket into `replays`.
  void AcceptReplayRequests(std::vector<Replay>& replays);
  // Sends each replay what its peer's queue takes, up to `budget` messages a
  // replay; drops the finished and the disconnected. True if any was sent.
  bool AdvanceReplays(const Kept& kept, std::vector<Replay>& replays, int budget);

  const Options options_;
  EventLog* const log_;
  std::unique_ptr<Sockets> sockets_;
  std::string bound_endpoint_, bound_replay_endpoint_;  // set by Start, before the thread
  std::atomic<bool> stop_{false};
  // Stats, written by the thread, read by scrapes.
  std::atomic<uint64_t> sent_{0};
  std::atomic<uint64_t> replays_done_{0};
  std::atomic<uint64_t> replays_abandoned_{0};
  std::atomic<uint64_t> replays_dropped_{0};
  std::atomic<int64_t> replays_active_{0};
  std::thread thread_;
};

}  // namespace mlakv::server
