// MessageRecycler: what it keeps and what it hands out.
//  * a message given back comes back from the next Take, cleared;
//  * one the caller's predicate refuses (too large) is freed, never kept;
//  * at most max_kept are kept, however many are given back;
//  * threads taking and giving at once (TSan) each get a message of their
//    own: none is handed to two threads.
#include "server/cq/message_recycler.h"

#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "mlakv/v1/kv_cache.pb.h"

namespace mlakv::server::cq {
namespace {

using Recycler = MessageRecycler<v1::AppendBatchRequest>;

TEST(MessageRecyclerTest, AGivenMessageComesBackCleared) {
  Recycler r(4, [](const v1::AppendBatchRequest&) { return true; });
  std::unique_ptr<v1::AppendBatchRequest> m = r.Take();
  m->set_pool("p");
  m->add_sequences()->set_sequence("s");
  const v1::AppendBatchRequest* given = m.get();
  r.Give(std::move(m));
  EXPECT_EQ(r.kept(), 1u);
  std::unique_ptr<v1::AppendBatchRequest> again = r.Take();
  EXPECT_EQ(again.get(), given);
  EXPECT_EQ(again->pool(), "");
  EXPECT_EQ(again->sequences_size(), 0);
  EXPECT_EQ(r.kept(), 0u);
  EXPECT_NE(r.Take(), nullptr);  // none kept: a fresh one
}

TEST(MessageRecyclerTest, WhatThePredicateRefusesIsNotKept) {
  Recycler r(4, [](const v1::AppendBatchRequest& m) { return m.ByteSizeLong() <= 100; });
  std::unique_ptr<v1::AppendBatchRequest> big = r.Take();
  big->set_pool(std::string(200, 'x'));
  r.Give(std::move(big));
  EXPECT_EQ(r.kept(), 0u);
  std::unique_ptr<v1::AppendBatchRequest> small = r.Take();
  small->set_pool("p");
  r.Give(std::move(small));
  EXPECT_EQ(r.kept(), 1u);
  r.Give(nullptr);
  EXPECT_EQ(r.kept(), 1u);
}

TEST(MessageRecyclerTest, KeepsAtMostMaxKept) {
  Recycler r(3, [](const v1::AppendBatchRequest&) { return true; });
  std::vector<std::unique_ptr<v1::AppendBatchRequest>> out;
  for (int i = 0; i < 10; ++i) out.push_back(r.Take());
  for (auto& m : out) r.Give(std::move(m));
  EXPECT_EQ(r.kept(), 3u);
}

TEST(MessageRecyclerTest, ThreadsNeverShareAMessage) {
  Recycler r(4, [](const v1::AppendBatchRequest&) { return true; });
  std::atomic<int> shared{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        std::unique_ptr<v1::AppendBatchRequest> m = r.Take();
        if (m->sequences_size() != 0 || !m->pool().empty()) shared.fetch_add(1);
        const std::string mine = absl::StrCat("t", t, "/", i);
        m->set_pool(mine);
        m->add_sequences()->set_sequence(mine);
        std::this_thread::yield();
        if (m->pool() != mine || m->sequences_size() != 1) shared.fetch_add(1);
        r.Give(std::move(m));
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(shared.load(), 0);
  EXPECT_LE(r.kept(), 4u);
}

}  // namespace
}  // namespace mlakv::server::cq
