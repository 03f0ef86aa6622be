// SerialExecutor: one worker thread, FIFO, the start hook first, every posted
// task run exactly once (also those still queued when it is destroyed), and
// what a poster wrote before Post visible to its task. Run under TSan
// (label tsan), the hand-offs between posters and the worker are checked too.
#include "server/core/serial_executor.h"

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace mlakv::server {
namespace {

TEST(SerialExecutorTest, RunsTasksInPostOrderOnOneOtherThread) {
  std::vector<int> order;  // touched only by the worker until it is joined
  std::thread::id worker_id;
  bool one_thread = true;
  {
    SerialExecutor executor;
    for (int i = 0; i < 100; ++i) {
      executor.Post([&, i] {
        if (i == 0) worker_id = std::this_thread::get_id();
        one_thread = one_thread && std::this_thread::get_id() == worker_id;
        order.push_back(i);
      });
    }
  }  // the destructor runs what is queued, then joins
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
  EXPECT_TRUE(one_thread);
  EXPECT_NE(worker_id, std::this_thread::get_id());
}

TEST(SerialExecutorTest, StartHookRunsOnTheWorkerBeforeAnyTask) {
  std::thread::id hook_thread, task_thread;
  std::vector<std::string> events;
  {
    SerialExecutor executor([&] {
      hook_thread = std::this_thread::get_id();
      events.push_back("start");
    });
    executor.Post([&] {
      task_thread = std::this_thread::get_id();
      events.push_back("task");
    });
  }
  EXPECT_EQ(events, (std::vector<std::string>{"start", "task"}));
  EXPECT_EQ(hook_thread, task_thread);
}

TEST(SerialExecutorTest, DestructorRunsTasksStillQueued) {
  std::atomic<int> ran{0};
  absl::Notification release;
  {
    SerialExecutor executor;
    executor.Post([&] { release.WaitForNotification(); });  // holds the worker
    for (int i = 0; i < 10; ++i) executor.Post([&] { ran.fetch_add(1); });
    EXPECT_EQ(executor.pending(), 11u);
    release.Notify();
  }
  EXPECT_EQ(ran.load(), 10);
}

TEST(SerialExecutorTest, PendingCountsTheRunningTask) {
  absl::Notification started, release;
  SerialExecutor executor;
  executor.Post([&] {
    started.Notify();
    release.WaitForNotification();
  });
  started.WaitForNotification();
  EXPECT_EQ(executor.pending(), 1u);
  release.Notify();
}

// load(): the busy time counts the tasks' run time (posted and RunHere, the
// running one included) and not the idle time between them.
TEST(SerialExecutorTest, LoadCountsTheTimeTasksRunAndNotTheIdleTime) {
  const auto begin = std::chrono::steady_clock::now();
  SerialExecutor executor;
  EXPECT_EQ(executor.load().busy_seconds, 0);
  const auto sleep = [] { std::this_thread::sleep_for(std::chrono::milliseconds(50)); };
  executor.RunHere(sleep);  // on this thread
  absl::Notification started, release;
  executor.Post([&] {
    sleep();
    started.Notify();
    release.WaitForNotification();
  });
  started.WaitForNotification();
  const SerialExecutor::Load running = executor.load();
  EXPECT_GE(running.busy_seconds, 0.1);  // both sleeps, the second task still running
  EXPECT_EQ(running.pending, 1u);
  release.Notify();
  executor.RunHere([] {});  // behind the posted task: it has finished when this returns
  // The worker marks itself idle just after the task that RunHere waited
  // for; wait for that before reading the total.
  while (executor.pending() != 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const double after = executor.load().busy_seconds;
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // idle
  const SerialExecutor::Load idle = executor.load();
  EXPECT_EQ(idle.busy_seconds, after);
  EXPECT_EQ(idle.pending, 0u);
  // At most the wall time less the idle 100 ms (and the waits before the sleeps).
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  EXPECT_LE(idle.busy_seconds, wall - 0.1);
}

// Posters on several threads hand the worker plain data (no atomics): every
// task sees what its poster wrote before Post, and runs exactly once.
TEST(SerialExecutorTest, ConcurrentPostersHandOverTheirData) {
  constexpr int kPosters = 4, kTasksEach = 200;
  std::vector<std::vector<int>> payloads(kPosters, std::vector<int>(kTasksEach, 0));
  std::vector<int> seen(kPosters * kTasksEach, 0);  // written by the worker only
  {
    SerialExecutor executor;
    std::vector<std::thread> posters;
    for (int p = 0; p < kPosters; ++p) {
      posters.emplace_back([&, p] {
        for (int i = 0; i < kTasksEach; ++i) {
          payloads[p][i] = p * kTasksEach + i + 1;
          executor.Post([&, p, i] { seen[p * kTasksEach + i] += payloads[p][i]; });
        }
      });
    }
    for (std::thread& t : posters) t.join();
  }
  for (int k = 0; k < kPosters * kTasksEach; ++k) ASSERT_EQ(seen[k], k + 1) << "task " << k;
}

}  // namespace
// RunHere on an idle executor runs the task on the calling thread, at once.
TEST(SerialExecutorTest, RunHereOnAnIdleExecutorRunsOnTheCallersThread) {
  SerialExecutor executor;
  std::thread::id ran_on;
  executor.RunHere([&] { ran_on = std::this_thread::get_id(); });
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_EQ(executor.pending(), 0u);
}

// While a task runs (or tasks are queued), RunHere queues its task behind
// them, on the worker, and returns only when it has run: never beside
// another task, and after what was posted before it.
TEST(SerialExecutorTest, RunHereOnABusyExecutorWaitsItsTurnOnTheWorker) {
  SerialExecutor executor;
  absl::Notification started, release;
  std::vector<int> order;  // touched by tasks only, which never overlap
  std::thread::id worker_id, ran_on;
  executor.Post([&] {
    worker_id = std::this_thread::get_id();
    started.Notify();
    release.WaitForNotification();
    order.push_back(0);
  });
  executor.Post([&] { order.push_back(1); });
  started.WaitForNotification();
  std::thread caller([&] {
    executor.RunHere([&] {
      ran_on = std::this_thread::get_id();
      order.push_back(2);
    });
    order.push_back(3);  // after RunHere returned: its task has run
  });
  while (executor.pending() < 3) std::this_thread::yield();  // the caller's task is queued
  release.Notify();
  caller.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(ran_on, worker_id);
}

// Posters and RunHere callers on many threads: no two tasks ever overlap,
// every task runs once, and each caller's tasks run in its order.
TEST(SerialExecutorTest, RunHereAndPostNeverOverlap) {
  SerialExecutor executor;
  std::atomic<int> inside{0}, overlaps{0}, ran{0};
  auto task = [&] {
    if (inside.fetch_add(1) != 0) overlaps.fetch_add(1);
    [[maybe_unused]] volatile int sink = 0;  // stores the compiler keeps: the loop takes time
    for (int spin = 0; spin < 200; ++spin) {
      sink = spin;
    }
    inside.fetch_sub(1);
    ran.fetch_add(1);
  };
  constexpr int kThreads = 6, kTasks = 300;
  std::vector<std::vector<int>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kTasks; ++i) {
        if (t % 2 == 0) {
          executor.RunHere([&, t, i] {
            task();
            seen[t].push_back(i);
          });
        } else {
          executor.Post([&, t, i] {
            task();
            seen[t].push_back(i);
          });
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  while (executor.pending() != 0) std::this_thread::yield();
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_EQ(ran.load(), kThreads * kTasks);
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(seen[t].size(), static_cast<size_t>(kTasks)) << t;
    for (int i = 0; i < kTasks; ++i) EXPECT_EQ(seen[t][i], i) << t;
  }
}

// RunOrPost on an idle executor runs the task on the calling thread before
// it returns; on a busy one it queues the task behind the others and returns
// at once (a completion-queue thread must never wait for a pool), the task
// then running on the worker in its turn.
TEST(SerialExecutorTest, RunOrPostRunsHereWhenIdleAndNeverWaitsWhenBusy) {
  SerialExecutor executor;
  std::thread::id ran_on;
  executor.RunOrPost([&] { ran_on = std::this_thread::get_id(); });
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_EQ(executor.pending(), 0u);

  absl::Notification started, release;
  std::vector<int> order;  // touched by tasks only, which never overlap
  std::thread::id worker_id, posted_on;
  executor.Post([&] {
    worker_id = std::this_thread::get_id();
    started.Notify();
    release.WaitForNotification();
    order.push_back(0);
  });
  started.WaitForNotification();
  absl::Notification ran;
  executor.RunOrPost([&] {
    posted_on = std::this_thread::get_id();
    order.push_back(1);
    ran.Notify();
  });
  // Returned while the first task still holds the executor: queued, not run.
  EXPECT_FALSE(ran.HasBeenNotified());
  EXPECT_EQ(executor.pending(), 2u);
  release.Notify();
  ran.WaitForNotification();
  EXPECT_EQ(order, (std::vector<int>{0, 1}));
  EXPECT_EQ(posted_on, worker_id);
}

// What a task run by RunOrPost asks to know where it runs (the Append
// stream's commit, which must not spin on a queue thread): the worker only
// for a task the worker runs, never for one run in place by a caller.
TEST(SerialExecutorTest, OnWorkerThreadIsTrueOnlyOnTheWorker) {
  SerialExecutor executor;
  EXPECT_FALSE(executor.OnWorkerThread());
  bool in_place = true, here = true;
  executor.RunOrPost([&] { in_place = executor.OnWorkerThread(); });
  executor.RunHere([&] { here = executor.OnWorkerThread(); });
  EXPECT_FALSE(in_place);
  EXPECT_FALSE(here);

  absl::Notification started, release, ran;
  bool posted = false, queued = false;
  executor.Post([&] {
    posted = executor.OnWorkerThread();
    started.Notify();
    release.WaitForNotification();
  });
  started.WaitForNotification();
  executor.RunOrPost([&] {  // the worker is busy: queued, run there
    queued = executor.OnWorkerThread();
    ran.Notify();
  });
  release.Notify();
  ran.WaitForNotification();
  EXPECT_TRUE(posted);
  EXPECT_TRUE(queued);
}

// RunOrPost from many threads beside Post and RunHere: no two tasks ever
// overlap, every task runs once, and each caller's tasks run in its order.
TEST(SerialExecutorTest, RunOrPostBesidePostAndRunHereNeverOverlaps) {
  SerialExecutor executor;
  std::atomic<int> inside{0}, overlaps{0}, ran{0};
  constexpr int kThreads = 6, kTasks = 300;
  std::vector<std::vector<int>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kTasks; ++i) {
        auto task = [&, t, i] {
          if (inside.fetch_add(1) != 0) overlaps.fetch_add(1);
          [[maybe_unused]] volatile int sink = 0;  // stores the compiler keeps: the loop takes time
          for (int spin = 0; spin < 200; ++spin) {
            sink = spin;
          }
          inside.fetch_sub(1);
          ran.fetch_add(1);
          seen[t].push_back(i);
        };
        switch (t % 3) {
          case 0: executor.RunOrPost(task); break;
          case 1: executor.Post(task); break;
          default: executor.RunHere(task); break;
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  while (executor.pending() != 0) std::this_thread::yield();
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_EQ(ran.load(), kThreads * kTasks);
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_EQ(seen[t].size(), static_cast<size_t>(kTasks)) << t;
    for (int i = 0; i < kTasks; ++i) EXPECT_EQ(seen[t][i], i) << t;
  }
}

}  // namespace mlakv::server
