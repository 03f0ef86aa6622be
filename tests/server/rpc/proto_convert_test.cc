// The response bounds the AppendBatch handler checks against the send limit
// before it commits (server/rpc/proto_convert.h): whatever a sequence's
// snapshot holds, its share of the response is never larger than its bound,
// in the Sequence form (SequenceProtoBytesBound) and in the packed one
// (PackedSequenceBytesBound) -- else a response could pass the limit after
// the rows were written.
#include "server/rpc/proto_convert.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace mlakv::server {
namespace {

// Snapshots as an append's commit makes them (SnapshotPages::kNew): the
// pages from `held_before` on, with the largest values each field can take
// when `extreme`.
SequenceSnapshot RandomSnapshot(std::mt19937& gen, uint32_t num_pages, bool extreme, size_t* held_before) {
  SequenceSnapshot s;
  std::uniform_int_distribution<uint32_t> page(0, num_pages - 1), small(0, 40);
  *held_before = small(gen);
  s.kv_indices_offset = static_cast<uint32_t>(*held_before);
  const uint32_t fresh = small(gen);
  for (uint32_t i = 0; i < fresh; ++i) s.kv_indices.push_back(static_cast<int32_t>(extreme ? num_pages - 1 : page(gen)));
  s.id = std::string(extreme ? 128 : small(gen), 'q');
  s.length = extreme ? (1u << 31) - 1 : gen();
  s.last_page_len = extreme ? 4096 : small(gen);
  s.page_size = extreme ? 4096 : 64;
  s.capacity_tokens = extreme ? (1u << 31) - 1 : gen();
  s.generation = extreme ? std::numeric_limits<uint64_t>::max() : gen();
  s.leases = extreme ? std::numeric_limits<uint32_t>::max() : 0;
  s.pinned = extreme;
  return s;
}

TEST(ResponseBounds, APackedSequenceNeverTakesMoreThanItsBound) {
  std::mt19937 gen(7);
  for (const uint32_t num_pages : {1u, 127u, 128u, 16384u, 2000000u}) {
    for (const bool extreme : {false, true}) {
      SCOPED_TRACE(::testing::Message() << num_pages << " " << extreme);
      v1::AppendBatchResponse response;
      uint64_t bound = kPackedSequencesFixedBytes;
      for (int i = 0; i < 300; ++i) {
        size_t held_before = 0;
        const SequenceSnapshot s = RandomSnapshot(gen, num_pages, extreme, &held_before);
        AddPacked(s, held_before, response.mutable_packed());
        bound += PackedSequenceBytesBound(s.kv_indices.size(), num_pages);
      }
      EXPECT_LE(response.ByteSizeLong(), bound);
      // Every sequence answered, its pages where the arrays say.
      const v1::PackedSequences& p = response.packed();
      EXPECT_EQ(p.lengths_size(), 300);
      uint64_t pages = 0;
      for (uint32_t n : p.new_page_counts()) pages += n;
      EXPECT_EQ(static_cast<uint64_t>(p.new_pages_size()), pages);
    }
  }
}

TEST(ResponseBounds, ASequenceMessageNeverTakesMoreThanItsBound) {
  std::mt19937 gen(8);
  for (const uint32_t num_pages : {1u, 128u, 2000000u}) {
    for (const bool extreme : {false, true}) {
      for (const v1::SequenceView view :
           {v1::SEQUENCE_VIEW_BASIC, v1::SEQUENCE_VIEW_COMPACT, v1::SEQUENCE_VIEW_LENGTHS}) {
        SCOPED_TRACE(::testing::Message() << num_pages << " " << extreme << " " << view);
        size_t held_before = 0;
        const SequenceSnapshot s = RandomSnapshot(gen, num_pages, extreme, &held_before);
        v1::Sequence out;
        ToProto(std::string(extreme ? 128 : 7, 'p'), s, &out, view, held_before);
        out.set_server_id(std::string(kMaxServerIdBytes, 's'));
        v1::AppendBatchResponse response;
        *response.add_sequences() = out;
        const size_t pages = held_before + s.kv_indices.size();
        EXPECT_LE(response.ByteSizeLong(),
                  SequenceProtoBytesBound(s.id.size(), extreme ? 128 : 7,
                                          PagesDescribed(view, pages, s.kv_indices.size()), num_pages, 0));
      }
    }
  }
}

}  // namespace
}  // namespace mlakv::server
