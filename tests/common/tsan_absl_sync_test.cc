// ThreadSanitizer builds only: abseil's synchronization, interposed by
// common/tsan_absl_sync.cc, orders memory for TSan as it does for the CPU.
//
// Each hand-off test writes plain (non-atomic) data on one thread and reads
// it on another, ordered by nothing but one abseil primitive; without the
// interposition TSan reports each of them as a data race (Debian's libabsl is
// uninstrumented). The reports are counted through TSan's __tsan_on_report
// hook, so a test fails on a report even when TSan is not told to halt.
// The control test races on purpose, in a child process, and expects TSan to
// say so: it proves that the build really runs TSan, so that the hand-off
// tests passing means something.
#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace {

std::atomic<int> tsan_reports{0};

}  // namespace

// TSan calls this (a weak default in its runtime) for every report it prints.
extern "C" void __tsan_on_report(void*) { tsan_reports.fetch_add(1); }

namespace mlakv {
namespace {

// The interposer computes Notification's flag address from this layout.
static_assert(sizeof(absl::Notification) == 2 * sizeof(absl::Mutex),
              "absl::Notification is no longer {Mutex; atomic<bool>}: update NotifiedYet() in "
              "common/tsan_absl_sync.cc");

class TsanAbslSync : public ::testing::Test {
 protected:
  void SetUp() override { reports_before_ = tsan_reports.load(); }
  void TearDown() override {
    EXPECT_EQ(tsan_reports.load(), reports_before_) << "ThreadSanitizer reported a race (see its report above)";
  }

 private:
  int reports_before_ = 0;
};

constexpr int kRounds = 200;

TEST_F(TsanAbslSync, MutexLockOrdersAHandOff) {
  absl::Mutex mu;
  std::vector<int> data;  // guarded by mu, written by both threads in turn
  bool ready = false;
  std::thread producer([&] {
    for (int i = 0; i < kRounds; ++i) {
      absl::MutexLock lock(&mu);
      data.push_back(i);
    }
    absl::MutexLock lock(&mu);
    ready = true;
  });
  int seen = 0;
  while (true) {
    absl::MutexLock lock(&mu);
    seen = static_cast<int>(data.size());
    if (ready) break;
  }
  producer.join();
  EXPECT_EQ(seen, kRounds);
}

TEST_F(TsanAbslSync, AwaitOrdersAHandOff) {
  absl::Mutex mu;
  int value = 0;  // written before the flag is set, read after Await returns
  bool set = false;
  std::thread writer([&] {
    value = 42;
    absl::MutexLock lock(&mu);
    set = true;
  });
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&set));
  }
  EXPECT_EQ(value, 42);
  writer.join();
}

TEST_F(TsanAbslSync, ReaderLocksSeeTheWriter) {
  absl::Mutex mu;
  std::vector<int> table(64, 0);
  std::thread writer([&] {
    for (int i = 0; i < kRounds; ++i) {
      absl::MutexLock lock(&mu);
      for (int& x : table) x = i;
    }
  });
  std::vector<std::thread> readers;
  std::atomic<bool> torn{false};
  for (int r = 0; r < 3; ++r) {
    readers.emplace_back([&] {
      for (int i = 0; i < kRounds; ++i) {
        absl::ReaderMutexLock lock(&mu);
        for (int x : table) {
          if (x != table[0]) torn.store(true);
        }
      }
    });
  }
  writer.join();
  for (std::thread& t : readers) t.join();
  EXPECT_FALSE(torn.load()) << "a reader saw a half-written table";
}

TEST_F(TsanAbslSync, CondVarWaitOrdersAHandOff) {
  absl::Mutex mu;
  absl::CondVar cv;
  int value = 0;
  bool set = false;
  std::thread writer([&] {
    value = 7;
    absl::MutexLock lock(&mu);
    set = true;
    cv.Signal();
  });
  {
    absl::MutexLock lock(&mu);
    while (!set) cv.WaitWithTimeout(&mu, absl::Milliseconds(50));
  }
  EXPECT_EQ(value, 7);
  writer.join();
}

TEST_F(TsanAbslSync, NotificationOrdersAHandOff) {
  absl::Notification done;
  int value = 0;
  std::thread writer([&] {
    value = 9;
    done.Notify();
  });
  done.WaitForNotification();
  EXPECT_EQ(value, 9);
  writer.join();
}

TEST_F(TsanAbslSync, HasBeenNotifiedOrdersAHandOff) {
  absl::Notification done;
  int value = 0;
  std::thread writer([&] {
    value = 11;
    done.Notify();
  });
  while (!done.HasBeenNotified()) std::this_thread::yield();
  EXPECT_EQ(value, 11);
  writer.join();
}

// Two threads write one int with no synchronization at all.
void RaceOnPurpose() {
  int shared = 0;
  std::thread a([&] { shared = 1; });
  std::thread b([&] { shared = 2; });
  a.join();
  b.join();
  std::exit(shared > 0 ? 0 : 1);
}

TEST(TsanAbslSyncControl, AnUnsynchronizedWriteIsReported) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // TSan's exit status after a report is 66 (TSAN_OPTIONS exitcode).
  EXPECT_EXIT(RaceOnPurpose(), ::testing::ExitedWithCode(66), "ThreadSanitizer: data race");
}

}  // namespace
}  // namespace mlakv
