// ThreadSanitizer builds only: MLAKV_TSAN_HAPPENS_BEFORE/AFTER order memory
// for TSan. The hand-off goes through a relaxed atomic flag, which orders
// nothing (for the CPU model or for TSan): without the annotations the read
// of `value` races with its write, and the control test shows TSan says so.
#include "common/tsan_annotations.h"

#include <atomic>
#include <cstdlib>
#include <thread>

#include "gtest/gtest.h"

namespace {

std::atomic<int> tsan_reports{0};

}  // namespace

// TSan calls this (a weak default in its runtime) for every report it prints.
extern "C" void __tsan_on_report(void*) { tsan_reports.fetch_add(1); }

namespace mlakv {
namespace {

// Writes `value`, then raises `flag` (relaxed); the reader spins on the flag.
template <bool kAnnotated>
int HandOff() {
  int value = 0;
  std::atomic<bool> flag{false};
  std::thread writer([&] {
    value = 5;
    if (kAnnotated) MLAKV_TSAN_HAPPENS_BEFORE(&flag);
    flag.store(true, std::memory_order_relaxed);
  });
  while (!flag.load(std::memory_order_relaxed)) std::this_thread::yield();
  if (kAnnotated) MLAKV_TSAN_HAPPENS_AFTER(&flag);
  const int seen = value;
  writer.join();
  return seen;
}

TEST(TsanAnnotations, HappensBeforeOrdersAHandOff) {
  const int before = tsan_reports.load();
  EXPECT_EQ(HandOff<true>(), 5);
  EXPECT_EQ(tsan_reports.load(), before) << "ThreadSanitizer reported a race (see its report above)";
}

TEST(TsanAnnotations, WithoutThemTheSameHandOffIsReported) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // TSan's exit status after a report is 66 (TSAN_OPTIONS exitcode).
  EXPECT_EXIT(std::exit(HandOff<false>() == 5 ? 0 : 1), ::testing::ExitedWithCode(66), "ThreadSanitizer: data race");
}

}  // namespace
}  // namespace mlakv
