// ParallelCopy: every byte of every job lands where it should, for copies
// below and above the parallel threshold, odd sizes, and many calls in a row
// (each call reuses the helpers and rebuilds the chunk list).
#include "server/backend/parallel_copy.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace mlakv::server {
namespace {

struct Buffers {
  std::vector<uint8_t> src, dst;
};

void CheckManyCalls(int helpers, uint32_t seed) {
  ParallelCopy copier(helpers);
  std::mt19937 rng(seed);
  for (int call = 0; call < 120; ++call) {
    // 1..5 jobs of 0 .. ~3 MB (odd sizes; about half the calls cross the threshold).
    const int jobs = 1 + static_cast<int>(rng() % 5);
    std::vector<Buffers> buffers(jobs);
    std::vector<CopyJob> list;
    for (Buffers& b : buffers) {
      const size_t bytes = rng() % 2 == 0 ? rng() % 4096 : rng() % (3u << 20);
      b.src.resize(bytes);
      for (size_t i = 0; i < bytes; i += 97) b.src[i] = static_cast<uint8_t>(rng());
      b.dst.assign(bytes, 0xEE);
      list.push_back({b.dst.data(), b.src.data(), bytes});
    }
    copier.Copy(list);
    for (size_t j = 0; j < buffers.size(); ++j) {
      ASSERT_EQ(buffers[j].dst, buffers[j].src) << "helpers " << helpers << " call " << call << " job " << j;
    }
  }
}

TEST(ParallelCopy, CopiesEveryByteWithoutHelpers) { CheckManyCalls(0, 1); }
TEST(ParallelCopy, CopiesEveryByteWithOneHelper) { CheckManyCalls(1, 2); }
TEST(ParallelCopy, CopiesEveryByteWithThreeHelpers) { CheckManyCalls(3, 3); }

TEST(ParallelCopy, LargeCopyIsSplitIntoChunksAndComplete) {
  ParallelCopy copier(3);
  const size_t bytes = 16 * ParallelCopy::kChunkBytes + 12345;  // many chunks, a short last one
  std::vector<uint8_t> src(bytes), dst(bytes, 0);
  for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  const CopyJob job{dst.data(), src.data(), bytes};
  copier.Copy({&job, 1});
  EXPECT_EQ(dst, src);
}

TEST(ParallelCopy, DestroyingAnIdleCopierJoinsItsHelpers) {
  for (int i = 0; i < 20; ++i) ParallelCopy copier(2);  // constructed and destroyed without a call
}

}  // namespace
}  // namespace mlakv::server
