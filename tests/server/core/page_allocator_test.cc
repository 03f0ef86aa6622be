#include "server/core/page_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

namespace mlakv::server {
namespace {

TEST(PageAllocatorTest, RejectsEmptyPool) {
  EXPECT_EQ(PageAllocator::Create({.num_pages = 0}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PageAllocatorTest, FreshPoolHandsOutLowestIdsFirst) {
  auto a = PageAllocator::Create({.num_pages = 8});
  ASSERT_TRUE(a.ok()) << a.status();
  auto pages = (*a)->Allocate(3);
  ASSERT_TRUE(pages.ok()) << pages.status();
  EXPECT_EQ(*pages, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ((*a)->used_count(), 3);
  EXPECT_EQ((*a)->free_count(), 5);
}

TEST(PageAllocatorTest, ExhaustionTakesNothing) {
  auto a = PageAllocator::Create({.num_pages = 4});
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE((*a)->Allocate(3).ok());
  auto more = (*a)->Allocate(2);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted) << more.status();
  EXPECT_EQ((*a)->free_count(), 1);
  EXPECT_TRUE((*a)->Allocate(1).ok());
  EXPECT_EQ((*a)->free_count(), 0);
}

TEST(PageAllocatorTest, DoubleFreeAndForeignIdsAreRejectedAtomically) {
  auto a = PageAllocator::Create({.num_pages = 4});
  ASSERT_TRUE(a.ok());
  auto pages = (*a)->Allocate(2);
  ASSERT_TRUE(pages.ok());
  EXPECT_EQ((*a)->Unref(std::vector<int32_t>{0, 0}).code(), absl::StatusCode::kInternal);
  EXPECT_EQ((*a)->Unref(std::vector<int32_t>{0, 7}).code(), absl::StatusCode::kInternal);
  EXPECT_EQ((*a)->Unref(std::vector<int32_t>{0, 3}).code(), absl::StatusCode::kInternal);  // 3 is free
  EXPECT_EQ((*a)->used_count(), 2) << "a rejected Free frees nothing";
  EXPECT_TRUE((*a)->IsUsed(0));
  ASSERT_TRUE((*a)->Unref(*pages).ok());
  EXPECT_EQ((*a)->free_count(), 4);
}

TEST(PageAllocatorTest, RandomWorkloadKeepsFreePlusUsedEqualTotal) {
  auto a = PageAllocator::Create({.num_pages = 100});
  ASSERT_TRUE(a.ok());
  std::mt19937 gen(7);
  std::vector<int32_t> held;
  for (int step = 0; step < 5000; ++step) {
    if (gen() % 2 == 0) {
      const int n = static_cast<int>(gen() % 10);
      auto pages = (*a)->Allocate(n);
      if (n > static_cast<int>(100 - held.size())) {
        EXPECT_FALSE(pages.ok());
      } else {
        ASSERT_TRUE(pages.ok()) << pages.status();
        held.insert(held.end(), pages->begin(), pages->end());
      }
    } else if (!held.empty()) {
      std::shuffle(held.begin(), held.end(), gen);
      const size_t n = gen() % (held.size() + 1);
      std::vector<int32_t> out(held.end() - n, held.end());
      held.resize(held.size() - n);
      ASSERT_TRUE((*a)->Unref(out).ok());
    }
    ASSERT_EQ((*a)->free_count() + (*a)->used_count(), (*a)->total());
    ASSERT_EQ((*a)->used_count(), static_cast<int32_t>(held.size()));
  }
  std::set<int32_t> unique(held.begin(), held.end());
  EXPECT_EQ(unique.size(), held.size()) << "no page handed out twice";
}

}  // namespace
}  // namespace mlakv::server

namespace mlakv::server {
namespace {

TEST(PageAllocatorTest, ReferencesKeepAPageUsedAndASharedPageCountsOnce) {
  auto a = PageAllocator::Create({.num_pages = 4});
  ASSERT_TRUE(a.ok());
  auto pages = (*a)->Allocate(2);
  ASSERT_TRUE(pages.ok());
  ASSERT_TRUE((*a)->Ref(std::vector<int32_t>{0, 0}).ok());  // two more holders of page 0
  EXPECT_EQ((*a)->refs(0), 3);
  EXPECT_EQ((*a)->shared_count(), 1);
  EXPECT_EQ((*a)->used_count(), 2) << "a shared page counts once";
  EXPECT_EQ((*a)->Ref(std::vector<int32_t>{2}).code(), absl::StatusCode::kInternal) << "page 2 is free";
  EXPECT_EQ((*a)->refs(0), 3) << "a rejected Ref changes nothing";
  std::vector<int32_t> freed;
  ASSERT_TRUE((*a)->Unref(std::vector<int32_t>{0, 1}, &freed).ok());
  EXPECT_EQ(freed, std::vector<int32_t>{1});
  EXPECT_EQ((*a)->shared_count(), 1);
  // Listed more often than referenced: rejected, nothing changes.
  EXPECT_EQ((*a)->Unref(std::vector<int32_t>{0, 0, 0}).code(), absl::StatusCode::kInternal);
  EXPECT_EQ((*a)->refs(0), 2);
  freed.clear();
  ASSERT_TRUE((*a)->Unref(std::vector<int32_t>{0, 0}, &freed).ok());
  EXPECT_EQ(freed, std::vector<int32_t>{0}) << "freed once although listed twice";
  EXPECT_EQ((*a)->shared_count(), 0);
  EXPECT_EQ((*a)->free_count(), 4);
  auto again = (*a)->Allocate(4);
  ASSERT_TRUE(again.ok()) << "the free list holds each page once";
  std::set<int32_t> unique(again->begin(), again->end());
  EXPECT_EQ(unique.size(), 4u);
}

}  // namespace
}  // namespace mlakv::server
