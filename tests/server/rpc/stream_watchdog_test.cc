// StreamWatchdog: ticks every registered stream, and never one that removed itself.
#include "server/rpc/stream_watchdog.h"

#include <gtest/gtest.h>

#include <atomic>

namespace mlakv::server {
namespace {

class Counter : public StreamWatchdog::Watched {
 public:
  void OnWatchdogTick(absl::Time) override { ticks.fetch_add(1); }
  std::atomic<int> ticks{0};
};

TEST(StreamWatchdog, TicksRegisteredStreamsUntilRemoved) {
  StreamWatchdog dog(absl::Milliseconds(5));
  Counter a, b;
  dog.Add(&a);
  dog.Add(&b);
  absl::SleepFor(absl::Milliseconds(60));
  EXPECT_GT(a.ticks.load(), 2);
  EXPECT_GT(b.ticks.load(), 2);
  dog.Remove(&a);
  const int frozen = a.ticks.load();  // Remove waited for any tick in progress
  absl::SleepFor(absl::Milliseconds(40));
  EXPECT_EQ(a.ticks.load(), frozen);
  EXPECT_EQ(dog.size(), 1u);
  dog.Remove(&b);
}

TEST(StreamWatchdog, RemovalRacingTicksNeverTouchesADeletedStream) {
  StreamWatchdog dog(absl::Microseconds(50));
  for (int i = 0; i < 2000; ++i) {
    auto* c = new Counter;
    dog.Add(c);
    dog.Remove(c);
    delete c;  // a tick after Remove would be a use after free (ASan)
  }
}

}  // namespace
}  // namespace mlakv::server
