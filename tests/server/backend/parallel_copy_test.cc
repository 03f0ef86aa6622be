// ParallelCopy: every byte of every job lands where it should, for copies
// below and above the parallel threshold, odd sizes, and many calls in a row
// (each call reuses the helpers and rebuilds the chunk list).
#include "server/backend/parallel_copy.h"

#include <algorithm>
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

// Copying the parts [cut_k, cut_k+1) of a staging buffer one after another
// (as the CUDA backend does, one part's DMA beside the next part's copy)
// writes exactly what one copy of all jobs writes, each byte once: jobs that
// straddle a cut are split, jobs outside a part are left out of it.
TEST(ParallelCopy, JobsWritingRangeCopiesEachByteOnceOverTheParts) {
  std::mt19937 rng(7);
  ParallelCopy copier(2);
  for (int trial = 0; trial < 50; ++trial) {
    const size_t bytes = 1 + rng() % (3u << 20);
    std::vector<uint8_t> src(bytes), whole(bytes, 0), parts(bytes, 0);
    for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<uint8_t>(rng());
    // Jobs over a shuffled cover of the destination with gaps (bytes no job writes).
    std::vector<CopyJob> whole_jobs, part_jobs;
    for (size_t at = 0; at < bytes;) {
      const size_t n = std::min<size_t>(bytes - at, 1 + rng() % (bytes / 3 + 1));
      if (rng() % 4 != 0) {
        whole_jobs.push_back({whole.data() + at, src.data() + at, n});
        part_jobs.push_back({parts.data() + at, src.data() + at, n});
      }
      at += n + rng() % 64;
    }
    std::shuffle(part_jobs.begin(), part_jobs.end(), rng);
    copier.Copy(whole_jobs);
    std::vector<size_t> cuts = {0, rng() % (bytes + 1), rng() % (bytes + 1), bytes};
    std::sort(cuts.begin(), cuts.end());
    size_t copied = 0;
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      const std::vector<CopyJob> part = JobsWritingRange(part_jobs, parts.data() + cuts[k], parts.data() + cuts[k + 1]);
      for (const CopyJob& j : part) {
        ASSERT_GE(static_cast<uint8_t*>(j.dst), parts.data() + cuts[k]);
        ASSERT_LE(static_cast<uint8_t*>(j.dst) + j.bytes, parts.data() + cuts[k + 1]);
        ASSERT_GT(j.bytes, 0u);
        copied += j.bytes;
      }
      copier.Copy(part);
    }
    size_t expected = 0;
    for (const CopyJob& j : whole_jobs) expected += j.bytes;
    EXPECT_EQ(copied, expected) << "trial " << trial;
    ASSERT_EQ(parts, whole) << "trial " << trial;
  }
}

TEST(ParallelCopy, DestroyingAnIdleCopierJoinsItsHelpers) {
  for (int i = 0; i < 20; ++i) ParallelCopy copier(2);  // constructed and destroyed without a call
}

}  // namespace
}  // namespace mlakv::server
