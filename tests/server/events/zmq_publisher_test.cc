// ZmqEventPublisher's replay socket: what it keeps is bounded by bytes as
// well as by batches (a batch of long hashed sequences is tens of KB; 10,000
// of them would be hundreds of MB), oldest first, numbers without gaps, the
// newest batch always answered. The wire format itself is checked against
// pyzmq and msgpack by tests/events/zmq_events_test.py.
#include "server/events/zmq_publisher.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <filesystem>
#include <functional>
#include <map>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace mlakv::server {
namespace {

int64_t SeqOf(const zmq::message_t& m) {
  if (m.size() != 8) return -2;
  uint64_t u = 0;
  for (size_t i = 0; i < 8; ++i) u = (u << 8) | static_cast<const uint8_t*>(m.data())[i];
  return static_cast<int64_t>(u);
}

std::string BigEndian(int64_t seq) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((static_cast<uint64_t>(seq) >> (56 - 8 * i)) & 0xFF);
  return out;
}

// A removed event of `pages` pages, each with a 40-byte hash.
KvEvent Removed(int pages, int salt) {
  KvEvent e;
  e.kind = KvEvent::Kind::kRemoved;
  e.pool = "default";
  e.sequence = "s";
  e.reason = "free";
  for (int i = 0; i < pages; ++i) {
    e.pages.push_back(i);
    e.block_hashes.push_back(absl::StrCat(std::string(30, 'h'), 1000000000 + salt * 1000 + i));
  }
  return e;
}

// ipc:// endpoints in a folder of their own, removed at the end.
struct IpcEndpoints {
  explicit IpcEndpoints(const std::string& name)
      : dir(std::filesystem::temp_directory_path() / absl::StrCat("mlakv-zmq-", name, "-", getpid())),
        pub(absl::StrCat("ipc://", dir, "/pub")),
        replay(absl::StrCat("ipc://", dir, "/replay")) {
    std::filesystem::create_directories(dir);
  }
  ~IpcEndpoints() { std::filesystem::remove_all(dir); }
  const std::string dir, pub, replay;
};

// A DEALER connected to the replay socket; rcvhwm 0 and rcvtimeo -1 leave
// ZeroMQ's defaults (1,000 messages; wait forever).
zmq::socket_t ReplayReader(zmq::context_t& ctx, const std::string& endpoint, int rcvhwm = 0, int rcvtimeo_ms = 5000) {
  zmq::socket_t reader(ctx, zmq::socket_type::dealer);
  reader.set(zmq::sockopt::linger, 0);
  if (rcvhwm > 0) reader.set(zmq::sockopt::rcvhwm, rcvhwm);
  reader.set(zmq::sockopt::rcvtimeo, rcvtimeo_ms);
  reader.connect(endpoint);
  return reader;
}

// A SUB to every topic with a receive queue of `rcvhwm` messages (0: no limit).
zmq::socket_t Subscriber(zmq::context_t& ctx, const std::string& endpoint, int rcvhwm) {
  zmq::socket_t sub(ctx, zmq::socket_type::sub);
  sub.set(zmq::sockopt::linger, 0);
  sub.set(zmq::sockopt::rcvhwm, rcvhwm);
  sub.set(zmq::sockopt::subscribe, "");
  sub.connect(endpoint);
  return sub;
}

// Sends a replay request ["", start].
void AskReplay(zmq::socket_t& reader, int64_t start) {
  const std::string start_bytes = BigEndian(start);
  std::array<zmq::const_buffer, 2> request = {zmq::str_buffer(""), zmq::buffer(start_bytes)};
  zmq::send_multipart(reader, request);
}

struct Replayed {
  std::vector<int64_t> seqs;
  std::vector<std::string> payloads;  // [seqs]
  size_t payload_bytes = 0;
  bool ended = false;  // the end marker came
};

// What the reader receives until the end marker, a timeout or a reply of the wrong shape.
Replayed ReadReplay(zmq::socket_t& reader) {
  Replayed out;
  while (true) {
    std::vector<zmq::message_t> reply;
    if (!zmq::recv_multipart(reader, std::back_inserter(reply))) break;  // timed out
    if (reply.size() != 3) break;
    const int64_t seq = SeqOf(reply[1]);
    if (seq == -1) {
      out.ended = true;
      break;
    }
    out.seqs.push_back(seq);
    out.payload_bytes += reply[2].size();
    out.payloads.push_back(reply[2].to_string());
  }
  return out;
}

Replayed Replay(zmq::context_t& ctx, const std::string& endpoint, int64_t start) {
  zmq::socket_t reader = ReplayReader(ctx, endpoint);
  AskReplay(reader, start);
  return ReadReplay(reader);
}

bool WaitFor(const std::function<bool()>& done, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!done() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(2));
  return done();
}

// Records `n` batches of one event of `pages` hashed pages each (200: ~8.7
// KB), each after the last one was published, and waits for the last.
void PublishBatches(EventLog& log, ZmqEventPublisher& publisher, int n, int pages = 200) {
  const uint64_t before = publisher.stats().batches;
  for (int i = 0; i < n; ++i) {
    log.Record(Removed(pages, i));
    ASSERT_TRUE(WaitFor([&] { return publisher.stats().batches == before + i + 1; }, absl::Seconds(10)))
        << "batch " << i << " not published";
  }
}

TEST(ZmqPublisherTest, TheReplayKeepsNoMoreThanItsBytesOldestFirst) {
  const IpcEndpoints ep("bytes");
  EventLog log({});
  constexpr size_t kReplayBytes = 64 << 10;
  auto publisher = ZmqEventPublisher::Start(
      {.endpoint = ep.pub, .replay_endpoint = ep.replay, .replay_batches = 10000, .replay_bytes = kReplayBytes}, &log);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  // One event per batch: each recorded after the last one was published.
  constexpr int kBatches = 30;
  const size_t one_payload = ZmqEventPublisher::EncodeBatch({Removed(200, 0)}, {}, 0.0).size();
  ASSERT_GT(one_payload, 8000u);
  PublishBatches(log, **publisher, kBatches);
  zmq::context_t ctx(1);
  const Replayed all = Replay(ctx, ep.replay, 0);
  ASSERT_TRUE(all.ended) << "no end marker";
  EXPECT_LE(all.payload_bytes, kReplayBytes) << "the replay kept more than its bytes";
  EXPECT_EQ(all.seqs.size(), kReplayBytes / one_payload) << "as many batches as fit, no fewer";
  ASSERT_FALSE(all.seqs.empty());
  EXPECT_EQ(all.seqs.back(), kBatches - 1) << "the newest batch is kept";
  for (size_t i = 1; i < all.seqs.size(); ++i) EXPECT_EQ(all.seqs[i], all.seqs[i - 1] + 1) << "no gap";
  // A start past what is kept answers from there; one before it, from the oldest.
  const Replayed tail = Replay(ctx, ep.replay, kBatches - 2);
  EXPECT_EQ(tail.seqs, (std::vector<int64_t>{kBatches - 2, kBatches - 1}));
  publisher->reset();
  log.Close();
}

// A batch larger than replay_bytes alone is still answered: the newest is
// always kept.
TEST(ZmqPublisherTest, ABatchLargerThanTheBoundIsStillReplayed) {
  const IpcEndpoints ep("big");
  EventLog log({});
  auto publisher =
      ZmqEventPublisher::Start({.endpoint = ep.pub, .replay_endpoint = ep.replay, .replay_bytes = 1024}, &log);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  PublishBatches(log, **publisher, 1);
  zmq::context_t ctx(1);
  const Replayed all = Replay(ctx, ep.replay, 0);
  ASSERT_TRUE(all.ended);
  EXPECT_EQ(all.seqs, std::vector<int64_t>{0});
  EXPECT_GT(all.payload_bytes, 1024u);
  publisher->reset();
  log.Close();
}

// A replay longer than ZeroMQ's send queue to one peer (1,000 messages by
// default) reaches a peer that reads slowly whole: every kept batch, in
// order, then the end marker. A ROUTER socket drops what it cannot queue,
// so a replay sent in one go would lose its middle and its end marker.
TEST(ZmqPublisherTest, ALongReplayReachesASlowReaderWhole) {
  const IpcEndpoints ep("slow");
  EventLog log({});
  auto publisher = ZmqEventPublisher::Start({.endpoint = ep.pub, .replay_endpoint = ep.replay}, &log);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  constexpr int kBatches = 3000;
  PublishBatches(log, **publisher, kBatches, 20);
  zmq::context_t ctx(1);
  zmq::socket_t reader = ReplayReader(ctx, ep.replay, /*rcvhwm=*/10, /*rcvtimeo_ms=*/10000);
  AskReplay(reader, 0);
  absl::SleepFor(absl::Milliseconds(500));  // the publisher meets a full queue
  const Replayed got = ReadReplay(reader);
  const std::vector<int64_t>& seqs = got.seqs;
  EXPECT_TRUE(got.ended) << "no end marker after " << seqs.size() << " batches";
  ASSERT_EQ(seqs.size(), static_cast<size_t>(kBatches)) << "the replay lost batches";
  for (int i = 0; i < kBatches; ++i) ASSERT_EQ(seqs[i], i);
  publisher->reset();
  log.Close();
}

// A peer that asks for a replay and then reads nothing holds its slot only
// for replay_stall: publishing goes on meanwhile, a request past
// max_replays is dropped, and once the stalled replay ends the next asker
// gets everything.
TEST(ZmqPublisherTest, APeerThatStopsReadingHoldsNothingUpForLong) {
  const IpcEndpoints ep("stall");
  EventLog log({});
  auto publisher = ZmqEventPublisher::Start({.endpoint = ep.pub,
                                             .replay_endpoint = ep.replay,
                                             .max_replays = 1,
                                             .replay_queue = 4,
                                             .replay_stall = absl::Milliseconds(400)},
                                            &log);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  ZmqEventPublisher& p = **publisher;
  PublishBatches(log, p, 300);
  zmq::context_t ctx(1);
  zmq::socket_t stalled = ReplayReader(ctx, ep.replay, /*rcvhwm=*/1);
  AskReplay(stalled, 0);
  absl::SleepFor(absl::Milliseconds(50));
  // Publishing goes on while the replay waits.
  PublishBatches(log, p, 20);
  // The one slot is taken: another asker's request is dropped.
  zmq::socket_t other = ReplayReader(ctx, ep.replay, 0, /*rcvtimeo_ms=*/150);
  AskReplay(other, 0);
  std::vector<zmq::message_t> reply;
  EXPECT_FALSE(zmq::recv_multipart(other, std::back_inserter(reply))) << "a request past max_replays was answered";
  EXPECT_EQ(p.stats().replays_abandoned, 0u);
  EXPECT_EQ(p.stats().replays_dropped, 1u);
  EXPECT_EQ(p.stats().replays_active, 1);
  // The stalled replay ends; the other asks again and gets all 320.
  ASSERT_TRUE(WaitFor([&] { return p.stats().replays_abandoned == 1; }, absl::Seconds(5))) << "the stalled replay never ended";
  const Replayed all = Replay(ctx, ep.replay, 0);
  EXPECT_TRUE(all.ended);
  EXPECT_EQ(all.seqs.size(), 320u);
  EXPECT_EQ(p.stats().replays_done, 1u);
  EXPECT_TRUE(WaitFor([&] { return p.stats().replays_active == 0; }, absl::Seconds(1)));
  publisher->reset();
  log.Close();
}

// A peer that disconnects mid-replay ends its replay at once (the ROUTER
// answers EHOSTUNREACH for it), long before it would count as stalled.
TEST(ZmqPublisherTest, APeerThatLeavesMidReplayEndsIt) {
  const IpcEndpoints ep("gone");
  EventLog log({});
  auto publisher = ZmqEventPublisher::Start(
      {.endpoint = ep.pub, .replay_endpoint = ep.replay, .replay_queue = 4, .replay_stall = absl::Seconds(60)}, &log);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  ZmqEventPublisher& p = **publisher;
  PublishBatches(log, p, 500);  // ~4.4 MB: more than the socket buffers between the two
  zmq::context_t ctx(1);
  {
    zmq::socket_t leaver = ReplayReader(ctx, ep.replay, /*rcvhwm=*/1);
    AskReplay(leaver, 0);
    std::vector<zmq::message_t> first;
    ASSERT_TRUE(zmq::recv_multipart(leaver, std::back_inserter(first)));  // the replay has begun
  }  // closed mid-replay
  EXPECT_TRUE(WaitFor([&] { return p.stats().replays_abandoned == 1; }, absl::Seconds(5))) << "the replay outlived its peer";
  EXPECT_EQ(p.stats().replays_done, 0u);
  publisher->reset();
  log.Close();
}

// Batches queued to a slow replay reader share their bytes with the kept
// ones (no copy per reader); those that leave the kept ones while still
// queued arrive intact, byte for byte what the PUB socket sent, and the
// rest of the replay goes on from the oldest still kept.
TEST(ZmqPublisherTest, BatchesThatLeaveWhileQueuedArriveIntact) {
  const IpcEndpoints ep("evicted");
  EventLog log({});
  auto publisher = ZmqEventPublisher::Start(
      {.endpoint = ep.pub, .replay_endpoint = ep.replay, .replay_batches = 50, .replay_queue = 4}, &log);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  ZmqEventPublisher& p = **publisher;
  zmq::context_t ctx(1);
  zmq::socket_t sub = Subscriber(ctx, ep.pub, /*rcvhwm=*/0);  // keeps everything
  std::map<int64_t, std::string> published;
  const auto drain_sub = [&] {
    std::vector<zmq::message_t> m;
    while (zmq::recv_multipart(sub, std::back_inserter(m), zmq::recv_flags::dontwait)) {
      published[SeqOf(m[1])] = m[2].to_string();
      m.clear();
    }
  };
  const auto publish = [&](int n) {  // ~87 KB batches, one event each
    for (int i = 0; i < n; ++i) {
      PublishBatches(log, p, 1, 2000);
      drain_sub();
    }
  };
  // Batches until the subscriber sees one (its subscription has reached
  // the publisher); the replay below starts after them.
  for (int i = 0; i < 200 && published.empty(); ++i) {
    publish(1);
    absl::SleepFor(absl::Milliseconds(10));
    drain_sub();
  }
  ASSERT_FALSE(published.empty()) << "the subscriber never got a batch";
  const int64_t base = static_cast<int64_t>(p.stats().batches);
  published.clear();
  publish(50);
  zmq::socket_t reader = ReplayReader(ctx, ep.replay, /*rcvhwm=*/1);
  AskReplay(reader, 0);
  absl::SleepFor(absl::Milliseconds(200));  // its queue fills
  publish(100);                             // the first 100 of them leave the kept ones
  ASSERT_TRUE(WaitFor(
      [&] {
        drain_sub();
        return published.size() == 150;
      },
      absl::Seconds(5)))
      << "the subscriber got " << published.size() << " of 150 batches";
  const Replayed got = ReadReplay(reader);
  ASSERT_TRUE(got.ended) << "after " << got.seqs.size();
  const std::vector<int64_t>& seqs = got.seqs;
  for (size_t i = 0; i < seqs.size(); ++i) {
    EXPECT_EQ(got.payloads[i], published[seqs[i]]) << "batch " << seqs[i] << " changed in the queue";
  }
  ASSERT_FALSE(seqs.empty());
  EXPECT_EQ(seqs.front(), base);
  EXPECT_EQ(seqs.back(), base + 149);
  for (size_t i = 1; i < seqs.size(); ++i) ASSERT_GT(seqs[i], seqs[i - 1]);
  EXPECT_LT(seqs.size(), 150u) << "some queued batches had left, so a gap";
  EXPECT_GE(std::count_if(seqs.begin(), seqs.end(), [&](int64_t s) { return s >= base + 100; }), 50);
  publisher->reset();
  log.Close();
}

// A subscriber that stops reading holds at most send_queue batches at the
// publisher (plus what the sockets' buffers take); the rest are dropped for
// it, and the numbers it reads show the gap. With ZeroMQ's default (1,000)
// the same subscriber keeps all 300.
TEST(ZmqPublisherTest, ASubscriberThatStopsReadingHoldsAtMostItsSendQueue) {
  const auto received_by_a_stalled_subscriber = [](int send_queue, const std::string& name) {
    const IpcEndpoints ep(name);
    EventLog log({});
    ZmqEventPublisher::Options o{.endpoint = ep.pub};
    if (send_queue > 0) o.send_queue = send_queue;
    auto publisher = ZmqEventPublisher::Start(o, &log);
    EXPECT_TRUE(publisher.ok()) << publisher.status();
    if (!publisher.ok()) return std::vector<int64_t>{};
    zmq::context_t ctx(1);
    zmq::socket_t sub = Subscriber(ctx, ep.pub, /*rcvhwm=*/1);
    sub.set(zmq::sockopt::rcvbuf, 64 << 10);
    std::vector<int64_t> seqs;
    const auto drain = [&](int timeout_ms) {
      sub.set(zmq::sockopt::rcvtimeo, timeout_ms);
      std::vector<zmq::message_t> m;
      while (zmq::recv_multipart(sub, std::back_inserter(m))) {
        seqs.push_back(SeqOf(m[1]));
        m.clear();
      }
    };
    // Batches until one arrives (the subscription reached the publisher).
    for (int i = 0; i < 200 && seqs.empty(); ++i) {
      PublishBatches(log, **publisher, 1, 2000);
      drain(10);
    }
    EXPECT_FALSE(seqs.empty()) << "the subscriber never got a batch";
    seqs.clear();
    PublishBatches(log, **publisher, 300, 2000);  // ~87 KB each, nobody reading
    absl::SleepFor(absl::Milliseconds(200));       // what is queued reaches the socket
    drain(500);
    publisher->reset();
    log.Close();
    return seqs;
  };
  const std::vector<int64_t> bounded = received_by_a_stalled_subscriber(4, "sendq4");
  EXPECT_LT(bounded.size(), 40u) << "a queue of 4 held " << bounded.size() << " batches of 300";
  ASSERT_FALSE(bounded.empty());
  EXPECT_LT(bounded.back() - bounded.front() + 1, 300) << "the newest were dropped: a gap at the end";
  for (size_t i = 1; i < bounded.size(); ++i) EXPECT_GT(bounded[i], bounded[i - 1]);
  const std::vector<int64_t> all = received_by_a_stalled_subscriber(0, "sendq-default");
  EXPECT_EQ(all.size(), 300u) << "ZeroMQ's default queue of 1,000 holds them all";
}

// What a peer sends the replay socket is not trusted: requests of the
// wrong shape are left unanswered, a frame over 256 bytes disconnects its
// sender (ZMQ_MAXMSGSIZE), and a good request afterwards is answered.
TEST(ZmqPublisherTest, MalformedReplayRequestsAreIgnored) {
  const IpcEndpoints ep("bad");
  EventLog log({});
  auto publisher = ZmqEventPublisher::Start({.endpoint = ep.pub, .replay_endpoint = ep.replay}, &log);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  ZmqEventPublisher& p = **publisher;
  PublishBatches(log, p, 3);
  zmq::context_t ctx(1);
  const std::string start = BigEndian(0);
  const std::vector<std::vector<std::string>> bad = {
      {""},                                    // no start
      {start},                                 // no empty delimiter
      {"", start.substr(0, 7)},                // 7 bytes
      {"", start + "x"},                       // 9 bytes
      {"x", start},                            // a non-empty delimiter
      {"", start, "more"},                     // a frame too many
      {"", std::string(300, '\xff')},          // over the size limit: disconnected
      {std::string(100000, 'a'), "", start}};  // so is this one
  for (const std::vector<std::string>& frames : bad) {
    zmq::socket_t dealer = ReplayReader(ctx, ep.replay, 0, /*rcvtimeo_ms=*/150);
    std::vector<zmq::const_buffer> message;
    for (const std::string& f : frames) message.push_back(zmq::buffer(f));
    zmq::send_multipart(dealer, message);
    std::vector<zmq::message_t> reply;
    EXPECT_FALSE(zmq::recv_multipart(dealer, std::back_inserter(reply))) << "answered a request of " << frames.size()
                                                                          << " frames";
  }
  {
    // A request of 100,000 frames: read frame by frame (the publisher keeps
    // three), ignored like any other of the wrong shape.
    zmq::socket_t dealer = ReplayReader(ctx, ep.replay, 0, /*rcvtimeo_ms=*/300);
    dealer.send(zmq::str_buffer(""), zmq::send_flags::sndmore);
    for (int i = 0; i < 100000; ++i) dealer.send(zmq::buffer(start), zmq::send_flags::sndmore);
    dealer.send(zmq::buffer(start), zmq::send_flags::none);
    std::vector<zmq::message_t> reply;
    EXPECT_FALSE(zmq::recv_multipart(dealer, std::back_inserter(reply))) << "answered a request of 100,002 frames";
  }
  EXPECT_EQ(p.stats().replays_done + p.stats().replays_abandoned + p.stats().replays_dropped, 0u);
  const Replayed all = Replay(ctx, ep.replay, 0);
  EXPECT_TRUE(all.ended);
  EXPECT_EQ(all.seqs, (std::vector<int64_t>{0, 1, 2}));
  publisher->reset();
  log.Close();
}

}  // namespace
}  // namespace mlakv::server
