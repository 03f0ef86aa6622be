// ParallelCopy: every byte of every job lands where it should, for copies
// below and above the parallel threshold, odd sizes, and many calls in a row
// (each call reuses the helpers and rebuilds the chunk list).
#include "server/backend/parallel_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <utility>
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

// The per-chunk callback (what starts the CUDA backend's DMA of each chunk):
// called once per chunk of at most kChunkBytes, after that chunk's bytes are
// in place, and together the chunks cover every job's destination exactly
// once -- below the parallel threshold (the caller alone) and above it.
TEST(ParallelCopy, EveryChunkIsReportedOnceAfterItsBytesAreCopied) {
  for (const int helpers : {0, 3}) {
    ParallelCopy copier(helpers);
    for (const size_t bytes : {size_t{1000}, 3 * ParallelCopy::kChunkBytes + 17, 9 * ParallelCopy::kChunkBytes}) {
      std::vector<uint8_t> src(2 * bytes), dst(2 * bytes + 64, 0);
      for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 29 + 3);
      // Two jobs, the second at a gap after the first.
      const CopyJob jobs[2] = {{dst.data(), src.data(), bytes}, {dst.data() + bytes + 64, src.data() + bytes, bytes}};
      std::mutex mu;
      std::vector<std::pair<size_t, size_t>> seen;  // (offset in dst, bytes)
      bool copied_first = true;
      const ParallelCopy::AfterChunk after = [&](void* chunk, size_t n) {
        const auto* d = static_cast<const uint8_t*>(chunk);
        const size_t off = static_cast<size_t>(d - dst.data());
        const size_t src_off = off < bytes ? off : off - 64;
        const bool in_place = std::memcmp(d, src.data() + src_off, n) == 0;
        std::lock_guard<std::mutex> lock(mu);
        copied_first = copied_first && in_place;
        seen.emplace_back(off, n);
      };
      copier.Copy(jobs, &after);
      EXPECT_TRUE(copied_first) << "a chunk was reported before its bytes were copied";
      std::sort(seen.begin(), seen.end());
      size_t at = 0, total = 0;
      for (const auto& [off, n] : seen) {
        EXPECT_LE(n, ParallelCopy::kChunkBytes);
        if (at == bytes) at += 64;  // the gap between the jobs
        EXPECT_EQ(off, at) << "helpers " << helpers << " bytes " << bytes << ": chunks overlap or leave a hole";
        at = off + n;
        total += n;
      }
      EXPECT_EQ(total, 2 * bytes) << "helpers " << helpers;
      // A call without the callback after one with it reports nothing.
      seen.clear();
      copier.Copy(jobs);
      EXPECT_TRUE(seen.empty());
    }
  }
}

TEST(ParallelCopy, DestroyingAnIdleCopierJoinsItsHelpers) {
  for (int i = 0; i < 20; ++i) ParallelCopy copier(2);  // constructed and destroyed without a call
}

}  // namespace
}  // namespace mlakv::server
