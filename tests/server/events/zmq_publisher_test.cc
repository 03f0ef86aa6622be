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

struct Replayed {
  std::vector<int64_t> seqs;
  size_t payload_bytes = 0;
  bool ended = false;
};

Replayed Replay(zmq::context_t& ctx, const std::string& endpoint, int64_t start) {
  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.set(zmq::sockopt::rcvtimeo, 5000);
  dealer.connect(endpoint);
  const std::string start_bytes = BigEndian(start);
  std::array<zmq::const_buffer, 2> request = {zmq::str_buffer(""), zmq::buffer(start_bytes)};
  zmq::send_multipart(dealer, request);
  Replayed out;
  while (true) {
    std::vector<zmq::message_t> reply;
    if (!zmq::recv_multipart(dealer, std::back_inserter(reply))) break;  // timed out
    if (reply.size() != 3) break;
    const int64_t seq = SeqOf(reply[1]);
    if (seq == -1) {
      out.ended = true;
      break;
    }
    out.seqs.push_back(seq);
    out.payload_bytes += reply[2].size();
  }
  return out;
}

TEST(ZmqPublisherTest, TheReplayKeepsNoMoreThanItsBytesOldestFirst) {
  const std::string dir = std::filesystem::temp_directory_path() / absl::StrCat("mlakv-zmq-", getpid());
  std::filesystem::create_directories(dir);
  const std::string pub = absl::StrCat("ipc://", dir, "/pub"), replay = absl::StrCat("ipc://", dir, "/replay");
  EventLog log({});
  constexpr size_t kReplayBytes = 64 << 10;
  auto publisher = ZmqEventPublisher::Start(
      {.endpoint = pub, .replay_endpoint = replay, .replay_batches = 10000, .replay_bytes = kReplayBytes}, &log);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  // One event per batch: each recorded after the last one was published.
  constexpr int kBatches = 30;
  size_t one_payload = 0;
  for (int i = 0; i < kBatches; ++i) {
    if (i == 0) one_payload = ZmqEventPublisher::EncodeBatch({Removed(200, 0)}, {}, 0.0).size();
    log.Record(Removed(200, i));
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while ((*publisher)->batches_sent() < static_cast<uint64_t>(i + 1) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_EQ((*publisher)->batches_sent(), static_cast<uint64_t>(i + 1)) << "batch " << i << " not published";
  }
  ASSERT_GT(one_payload, 8000u);
  zmq::context_t ctx(1);
  const Replayed all = Replay(ctx, replay, 0);
  ASSERT_TRUE(all.ended) << "no end marker";
  EXPECT_LE(all.payload_bytes, kReplayBytes) << "the replay kept more than its bytes";
  EXPECT_EQ(all.seqs.size(), kReplayBytes / one_payload) << "as many batches as fit, no fewer";
  ASSERT_FALSE(all.seqs.empty());
  EXPECT_EQ(all.seqs.back(), kBatches - 1) << "the newest batch is kept";
  for (size_t i = 1; i < all.seqs.size(); ++i) EXPECT_EQ(all.seqs[i], all.seqs[i - 1] + 1) << "no gap";
  // A start past what is kept answers from there; one before it, from the oldest.
  const Replayed tail = Replay(ctx, replay, kBatches - 2);
  EXPECT_EQ(tail.seqs, (std::vector<int64_t>{kBatches - 2, kBatches - 1}));
  publisher->reset();
  log.Close();
  std::filesystem::remove_all(dir);
}

// A batch larger than replay_bytes alone is still answered: the newest is
// always kept.
TEST(ZmqPublisherTest, ABatchLargerThanTheBoundIsStillReplayed) {
  const std::string dir = std::filesystem::temp_directory_path() / absl::StrCat("mlakv-zmq-big-", getpid());
  std::filesystem::create_directories(dir);
  const std::string pub = absl::StrCat("ipc://", dir, "/pub"), replay = absl::StrCat("ipc://", dir, "/replay");
  EventLog log({});
  auto publisher =
      ZmqEventPublisher::Start({.endpoint = pub, .replay_endpoint = replay, .replay_bytes = 1024}, &log);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  log.Record(Removed(200, 1));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while ((*publisher)->batches_sent() < 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ((*publisher)->batches_sent(), 1u);
  zmq::context_t ctx(1);
  const Replayed all = Replay(ctx, replay, 0);
  ASSERT_TRUE(all.ended);
  EXPECT_EQ(all.seqs, std::vector<int64_t>{0});
  EXPECT_GT(all.payload_bytes, 1024u);
  publisher->reset();
  log.Close();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace mlakv::server
