// ParseAppendMessage (server/rpc/append_wire.h) leaves an Append message's
// rows in the slices they arrived in, and ParseAppendBatchMessage an
// AppendBatch request's (batch_layers' and every sequence's layers'); both
// must give exactly what protobuf's plain parse gives: for messages cut into slices anywhere (a varint, a tag
// or a row split between two slices), with fields in any order, a bytes
// field given twice, unknown fields, and for every truncation of a message
// and a handful of malformed ones, where both must refuse alike.
#include "server/rpc/append_wire.h"

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/server/rpc/append_wire_check.h"

namespace mlakv::server {
namespace {

using testing::CompareBatchWithPlainParse;
using testing::CompareWithPlainParse;
using testing::CutInto;

std::string Bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

v1::AppendRequest Message(int layers, size_t ckv_bytes, size_t kpe_bytes, uint64_t seed) {
  v1::AppendRequest m;
  m.set_pool("default");
  m.set_sequence("req-" + std::to_string(seed));
  m.set_start(64);
  m.set_row_count(3);
  m.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  m.set_expect_length(64);
  m.add_block_hashes("hash");
  for (int l = 0; l < layers; ++l) {
    v1::LayerRows* r = m.add_layers();
    r->set_layer(l);
    r->set_ckv(Bytes(ckv_bytes, seed * 31 + l));
    r->set_kpe(Bytes(kpe_bytes, seed * 37 + l));
    r->set_ckv_scale(0.125f);
    r->set_kpe_scale(0.5f);
  }
  return m;
}

void ExpectAgree(const std::vector<grpc::Slice>& slices, bool want_taken_apart) {
  const testing::WireVerdict v = CompareWithPlainParse(slices);
  ASSERT_TRUE(v.plain_ok);
  ASSERT_TRUE(v.split_ok);
  EXPECT_EQ(v.took_apart, want_taken_apart);
  EXPECT_TRUE(v.same) << v.difference;
}

TEST(ParseAppendMessage, RowsStayInTheSlicesWhereverTheMessageIsCut) {
  const std::string wire = Message(3, 3 * 1024, 3 * 128, 1).SerializeAsString();
  // Every cut point, one at a time: splits a tag, a length varint, a row.
  for (size_t cut = 1; cut < wire.size(); cut += 7) {
    SCOPED_TRACE(cut);
    ExpectAgree(CutInto(wire, {cut}), true);
  }
  // Many random cuts, including empty slices.
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<size_t> cuts;
    for (int i = 0; i < 20; ++i) cuts.push_back(rng() % (wire.size() + 1));
    std::sort(cuts.begin(), cuts.end());
    ExpectAgree(CutInto(wire, cuts), true);
  }
}

TEST(ParseAppendMessage, TheRowsArePiecesOfTheSlicesNotCopies) {
  const std::string wire = Message(1, 4096, 512, 2).SerializeAsString();
  std::vector<grpc::Slice> slices = CutInto(wire, {100, 2000, 4000});
  grpc::ByteBuffer raw(slices.data(), slices.size());
  ReceivedAppend received;
  ASSERT_TRUE(ParseAppendMessage(&raw, &received));
  ASSERT_EQ(received.rows.size(), 1u);
  const BytePieces& ckv = received.rows[0].ckv;
  EXPECT_EQ(ckv.size(), 4096u);
  EXPECT_GE(ckv.parts.size(), 3u);  // the ckv field spans the three cuts
  for (const std::string_view part : ckv.parts) {
    bool inside = false;
    for (const grpc::Slice& s : received.slices) {
      const char* b = reinterpret_cast<const char*>(s.begin());
      inside |= part.data() >= b && part.data() + part.size() <= b + s.size();
    }
    EXPECT_TRUE(inside) << "a piece outside the received slices";
  }
  EXPECT_EQ(raw.Length(), 0u) << "the slices moved to the parse";
}

// Wire-format pieces for hand-built messages: a field's tag, and a
// length-delimited field with its body.
std::string Tag(uint32_t number, uint32_t type) {
  std::string t;
  uint64_t tag = uint64_t{number} << 3 | type;
  while (tag >= 0x80) {
    t.push_back(static_cast<char>(tag | 0x80));
    tag >>= 7;
  }
  t.push_back(static_cast<char>(tag));
  return t;
}

std::string Len(uint32_t number, const std::string& body) {
  std::string out = Tag(number, 2);
  uint64_t n = body.size();
  while (n >= 0x80) {
    out.push_back(static_cast<char>(n | 0x80));
    n >>= 7;
  }
  out.push_back(static_cast<char>(n));
  return out + body;
}

TEST(ParseAppendMessage, FieldsInAnyOrderRepeatedBytesAndUnknownFields) {
  // The client's order (rows after the scales), protobuf's order, a ckv
  // field given twice (the last wins), unknown fields of every wire type
  // but groups at both levels, and a layer entry with no rows.
  const std::string first = Bytes(300, 1), second = Bytes(200, 2), kpe = Bytes(50, 3);
  std::string layer = Tag(1, 0) + "\x05" + Len(2, first) + Tag(4, 5) + std::string("\x00\x00\x80\x3e", 4) +
                      Len(2, second) + Len(3, kpe) + Tag(99, 0) + "\x2a" + Tag(98, 1) + std::string(8, 'x') +
                      Len(97, "unknown bytes");
  std::string top = Len(2, "seq") + Len(6, layer) + Tag(4, 0) + "\x03" + Len(6, "") + Tag(500, 5) + "abcd" +
                    Len(6, Len(3, kpe) + Tag(1, 0) + "\x01");
  ExpectAgree(CutInto(top, {}), true);
  ExpectAgree(CutInto(top, {5, 17, 333, 500}), true);
  ExpectAgree(CutInto(Message(2, 100, 10, 3).SerializeAsString(), {}), true);  // protobuf's own order
  v1::AppendRequest none;  // no layers at all
  none.set_sequence("x");
  ExpectAgree(CutInto(none.SerializeAsString(), {}), false);
}

TEST(ParseAppendMessage, EveryTruncationIsJudgedAsProtobufJudgesIt) {
  const std::string wire = Message(2, 64, 16, 4).SerializeAsString();
  int refused = 0;
  for (size_t n = 0; n < wire.size(); ++n) {
    SCOPED_TRACE(n);
    const testing::WireVerdict v = CompareWithPlainParse(CutInto(wire.substr(0, n), {n / 2}));
    EXPECT_EQ(v.split_ok, v.plain_ok);
    if (v.plain_ok) {
      EXPECT_TRUE(v.same) << v.difference;
    }
    refused += !v.plain_ok;
  }
  EXPECT_GT(refused, 0);
}

TEST(ParseAppendMessage, MalformedAndUnusualMessagesGetTheSameVerdict) {
  const std::vector<std::string> cases = {
      std::string("\x32\x05\x12\x10", 4),              // a layer whose ckv runs past the layer's end
      std::string("\x32\x02\x1b\x1c", 4),              // a group inside a layer (protobuf keeps it unknown)
      std::string("\x0b\x0c\x32\x00", 4),              // a group at the top
      std::string("\x00\x01", 2),                      // field number 0
      std::string("\x32\xff\xff\xff\xff\x0f", 6),      // a layer length of 2^32 - 1
      std::string("\x12\x02\xc3\x28", 4),              // a sequence that is not UTF-8
      std::string("\x30\x05", 2),                      // layers as a varint (protobuf: an unknown field)
      std::string("\x32\x03\x10\x80\x80", 5),          // a varint cut at the layer's end
      std::string("\x32\x02\x10\x80\x01", 5),          // a varint running past the layer's end
      std::string("\x32\x0b\x08\xff\xff\xff\xff\xff\xff\xff\xff\x01", 12),  // layer = 2^64 - 1, kept to 32 bits
      std::string("\x32\x02\x16\x00", 4),              // wire type 6 inside a layer
      // A tag of 6 bytes (protobuf reads tags of at most 5), and a length of
      // 6 bytes (the same for lengths): refused by protobuf, so not taken
      // apart here (the fuzzer's second find).
      std::string("\xb9\xf6\x80\xb1\x80\x00\x00\x00\x00\x00\x00\x00\x32\x06", 14),
      std::string("\x32\x82\x80\x80\x80\x80\x00\x08\x01", 9),
      std::string("\x32\x82\x80\x80\x80\x00\x08\x01", 8),  // the same length in 5 bytes: accepted
      // A NaN kpe_scale among unknown fields of the wrong wire types (the
      // fuzzer's first find: a comparison that called NaN unequal to itself).
      std::string("\x2d\xe0\x12\x01\x73\x32\x0f\x08\x03\x20\x3a\x0a\x01\x72\x10\x80\x20\x2d\x2d\xff\xff\xff", 22),
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    const testing::WireVerdict v = CompareWithPlainParse(CutInto(cases[i], {}));
    EXPECT_EQ(v.split_ok, v.plain_ok);
    if (v.plain_ok) {
      EXPECT_TRUE(v.same) << v.difference;
    }
  }
}

// An AppendBatch with both ways of carrying rows (the server refuses the
// mix later; the parse must still take both apart): `compact` batch_layers
// entries of 4 rows, and sequences of which the odd ones carry 2 layers.
v1::AppendBatchRequest Batch(int compact, int sequences, uint64_t seed) {
  v1::AppendBatchRequest m;
  m.set_pool("default");
  m.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  m.set_view(v1::SEQUENCE_VIEW_COMPACT);
  for (int i = 0; i < sequences; ++i) {
    v1::SequenceRows* s = m.add_sequences();
    s->set_sequence("seq-" + std::to_string(i));
    s->set_start(7);
    s->set_row_count(1);
    s->set_expect_length(7);
    s->add_block_hashes("h");
    for (int l = 0; i % 2 == 1 && l < 2; ++l) {
      v1::LayerRows* r = s->add_layers();
      r->set_layer(l);
      r->set_ckv(Bytes(1024, seed * 41 + i * 3 + l));
      r->set_kpe(Bytes(128, seed * 43 + i * 3 + l));
    }
  }
  for (int k = 0; k < compact; ++k) {
    v1::LayerRows* r = m.add_batch_layers();
    r->set_layer(k);
    r->set_ckv(Bytes(4 * 1024, seed * 47 + k));
    r->set_kpe(Bytes(4 * 128, seed * 53 + k));
    r->set_ckv_scale(0.25f);
  }
  return m;
}

void ExpectBatchAgrees(const std::vector<grpc::Slice>& slices, bool want_taken_apart) {
  const testing::WireVerdict v = CompareBatchWithPlainParse(slices);
  ASSERT_TRUE(v.plain_ok);
  ASSERT_TRUE(v.split_ok);
  EXPECT_EQ(v.took_apart, want_taken_apart);
  EXPECT_TRUE(v.same) << v.difference;
}

TEST(ParseAppendBatchMessage, RowsStayInTheSlicesWhereverTheRequestIsCut) {
  const std::string wire = Batch(3, 4, 1).SerializeAsString();
  for (size_t cut = 1; cut < wire.size(); cut += 11) {
    SCOPED_TRACE(cut);
    ExpectBatchAgrees(CutInto(wire, {cut}), true);
  }
  std::mt19937_64 rng(9);
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<size_t> cuts;
    for (int i = 0; i < 20; ++i) cuts.push_back(rng() % (wire.size() + 1));
    std::sort(cuts.begin(), cuts.end());
    ExpectBatchAgrees(CutInto(wire, cuts), true);
  }
  // Only the compact form, only per-sequence rows, and no rows at all.
  ExpectBatchAgrees(CutInto(Batch(2, 0, 2).SerializeAsString(), {300, 5000}), true);
  ExpectBatchAgrees(CutInto(Batch(0, 3, 3).SerializeAsString(), {40}), true);
  v1::AppendBatchRequest empty;
  ExpectBatchAgrees(CutInto(empty.SerializeAsString(), {}), true);
}

TEST(ParseAppendBatchMessage, TheRowsArePiecesOfTheSlicesNotCopies) {
  const std::string wire = Batch(2, 2, 4).SerializeAsString();
  std::vector<grpc::Slice> slices = CutInto(wire, {100, 3000, 6000, 9000});
  grpc::ByteBuffer raw(slices.data(), slices.size());
  ReceivedAppendBatch received;
  ASSERT_TRUE(ParseAppendBatchMessage(&raw, &received, /*split_min_bytes=*/0));
  ASSERT_TRUE(received.taken_apart);
  ASSERT_EQ(received.batch_rows.size(), 2u);
  ASSERT_EQ(received.sequence_rows.size(), 2u);
  EXPECT_TRUE(received.sequence_rows[0].empty());
  ASSERT_EQ(received.sequence_rows[1].size(), 2u);
  EXPECT_EQ(received.wire_bytes, wire.size());
  std::vector<const BytePieces*> all = {&received.batch_rows[0].ckv, &received.batch_rows[1].kpe,
                                        &received.sequence_rows[1][1].ckv};
  for (const BytePieces* pieces : all) {
    ASSERT_GT(pieces->size(), 0u);
    for (const std::string_view part : pieces->parts) {
      bool inside = false;
      for (const grpc::Slice& s : received.slices) {
        const char* b = reinterpret_cast<const char*>(s.begin());
        inside |= part.data() >= b && part.data() + part.size() <= b + s.size();
      }
      EXPECT_TRUE(inside) << "a piece outside the received slices";
    }
  }
  EXPECT_EQ(received.message.batch_layers(0).ckv(), "");
  EXPECT_EQ(received.message.sequences(1).layers(1).kpe(), "");
  EXPECT_EQ(raw.Length(), 0u) << "the slices moved to the parse";
}

TEST(ParseAppendBatchMessage, FieldsInAnyOrderRepeatedBytesAndUnknownFields) {
  const std::string first = Bytes(700, 5), second = Bytes(400, 6), kpe = Bytes(50, 7);
  // A layer entry with ckv twice (the last wins) and unknown fields; the
  // sequence holding it is over the 1 KiB below which entries stay whole.
  const std::string layer = Len(2, first) + Tag(1, 0) + "\x02" + Len(2, second) + Len(3, kpe) + Tag(99, 0) +
                            "\x2a" + Len(97, "unknown");
  // A sequence whose layers entry comes before its id, with an unknown field.
  const std::string sequence = Len(4, layer) + Len(1, "s") + Tag(3, 0) + "\x01" + Tag(77, 5) + "wxyz" + Len(4, "");
  // The top: batch_layers before sequences, interleaved, unknown fields.
  const std::string top = Len(5, layer) + Len(3, sequence) + Tag(600, 1) + std::string(8, 'q') + Len(5, Len(3, kpe)) +
                          Len(3, Len(1, "t")) + Len(1, "default") + Tag(4, 0) + "\x02";
  ExpectBatchAgrees(CutInto(top, {}), true);
  ExpectBatchAgrees(CutInto(top, {3, 19, 280, 400, 700}), true);
}

// What is small stays whole: a request under kSplitBatchMinBytes is parsed
// by protobuf alone (a decode step by reference: its ~9 KB would take twice
// as long to take apart and parse again), and in a large one a sequences
// entry under 1 KiB is copied whole, its rows with it; only the large ones
// and every batch_layers entry are taken apart.
TEST(ParseAppendBatchMessage, SmallRequestsAndSmallEntriesStayWhole) {
  const std::string small = Batch(2, 3, 10).SerializeAsString();
  ASSERT_LT(small.size(), kSplitBatchMinBytes);
  const testing::WireVerdict v = CompareBatchWithPlainParse(CutInto(small, {50}), kSplitBatchMinBytes);
  ASSERT_TRUE(v.split_ok);
  EXPECT_FALSE(v.took_apart);
  EXPECT_TRUE(v.same) << v.difference;

  v1::AppendBatchRequest large = Batch(3, 4, 8);  // sequences 1 and 3 with 2 x 1,152 bytes of rows
  v1::SequenceRows* tiny = large.add_sequences();  // rows of 100 bytes: under 1 KiB
  tiny->set_sequence("tiny");
  tiny->add_layers()->set_ckv(Bytes(100, 77));
  while (large.ByteSizeLong() < kSplitBatchMinBytes) {
    large.mutable_batch_layers(0)->mutable_ckv()->append(Bytes(8192, large.ByteSizeLong()));
  }
  const std::string wire = large.SerializeAsString();
  std::vector<grpc::Slice> slices = CutInto(wire, {1000, 30000});
  grpc::ByteBuffer raw(slices.data(), slices.size());
  ReceivedAppendBatch received;
  ASSERT_TRUE(ParseAppendBatchMessage(&raw, &received));  // the server's threshold
  ASSERT_TRUE(received.taken_apart);
  ASSERT_EQ(received.sequence_rows.size(), 5u);
  EXPECT_TRUE(received.sequence_rows[0].empty());  // no layers
  EXPECT_EQ(received.sequence_rows[1].size(), 2u);  // 2,304 bytes of rows: taken apart
  EXPECT_TRUE(received.sequence_rows[4].empty());  // "tiny": left whole
  EXPECT_EQ(received.message.sequences(4).layers(0).ckv(), Bytes(100, 77));
  EXPECT_EQ(received.message.sequences(1).layers(0).ckv(), "");
  EXPECT_EQ(received.message.batch_layers(0).ckv(), "");
  ExpectBatchAgrees(CutInto(wire, {1000, 30000}), true);
  EXPECT_TRUE(CompareBatchWithPlainParse(CutInto(wire, {7}), kSplitBatchMinBytes).same);
}

TEST(ParseAppendBatchMessage, EveryTruncationIsJudgedAsProtobufJudgesIt) {
  const std::string wire = Batch(1, 2, 8).SerializeAsString();
  int refused = 0;
  for (size_t n = 0; n < wire.size(); n += (n < 200 || n > wire.size() - 200) ? 1 : 37) {
    SCOPED_TRACE(n);
    const testing::WireVerdict v = CompareBatchWithPlainParse(CutInto(wire.substr(0, n), {n / 3}));
    EXPECT_EQ(v.split_ok, v.plain_ok);
    if (v.plain_ok) {
      EXPECT_TRUE(v.same) << v.difference;
    }
    refused += !v.plain_ok;
  }
  EXPECT_GT(refused, 0);
}

TEST(ParseAppendBatchMessage, MalformedAndUnusualRequestsGetTheSameVerdict) {
  const std::vector<std::string> cases = {
      std::string("\x2a\x05\x12\x10", 4),            // a batch_layers entry whose ckv runs past its end
      std::string("\x1a\x04\x22\x02\x12\x05", 6),    // a sequence's layer whose ckv runs past the layer
      std::string("\x1a\x02\x23\x24", 4),            // a group inside a sequence
      std::string("\x1a\x04\x22\x02\x1b\x1c", 6),    // a group inside a sequence's layer
      std::string("\x0a\x02\xc3\x28", 4),            // a pool that is not UTF-8
      std::string("\x1a\x04\x0a\x02\xc3\x28", 6),    // a sequence id that is not UTF-8
      std::string("\x28\x05", 2),                    // batch_layers as a varint (an unknown field)
      std::string("\x18\x05", 2),                    // sequences as a varint
      std::string("\x1a\x02\x20\x05", 4),            // a sequence's layers as a varint
      std::string("\x2a\x82\x80\x80\x80\x80\x00\x08\x01", 9),  // a 6-byte length
      std::string("\x1a\x03\x22\x01\x80", 5),        // a varint cut at the layer's end
      std::string("\x00\x01", 2),                    // field number 0
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    const testing::WireVerdict v = CompareBatchWithPlainParse(CutInto(cases[i], {}));
    EXPECT_EQ(v.split_ok, v.plain_ok);
    if (v.plain_ok) {
      EXPECT_TRUE(v.same) << v.difference;
    }
  }
}

// KeepForReuse bounds what a cleared request kept for the next call may hold:
// a decode step by reference is kept; a request past 32 KB, one of more than
// 2,048 entries however small (a hostile request of empty entries), and one
// taken apart are not.
ReceivedAppendBatch Received(const v1::AppendBatchRequest& m, size_t split_min_bytes = kSplitBatchMinBytes) {
  const std::string wire = m.SerializeAsString();
  grpc::Slice slice(wire.data(), wire.size());
  grpc::ByteBuffer raw(&slice, 1);
  ReceivedAppendBatch received;
  EXPECT_TRUE(ParseAppendBatchMessage(&raw, &received, split_min_bytes));
  return received;
}

v1::AppendBatchRequest DecodeStepByReference(int sequences, size_t id_bytes) {
  v1::AppendBatchRequest m;
  m.set_pool("default");
  m.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  m.set_view(v1::SEQUENCE_VIEW_PACKED);
  for (int i = 0; i < sequences; ++i) {
    v1::SequenceRows* s = m.add_sequences();
    std::string id = "request-" + std::to_string(i);
    id.resize(std::max(id.size(), id_bytes), 'x');
    s->set_sequence(id);
    s->set_start(1000 + i);
    s->set_row_count(1);
  }
  for (int l = 0; l < 61; ++l) {
    v1::LayerRows* r = m.add_batch_layers();
    r->set_layer(l);
    r->mutable_ckv_ref()->set_region("producer-0");
    r->mutable_ckv_ref()->set_offset(static_cast<uint64_t>(l) << 24);
    r->mutable_kpe_ref()->set_region("producer-0");
    r->mutable_kpe_ref()->set_offset((static_cast<uint64_t>(l) << 24) + (1 << 20));
  }
  return m;
}

TEST(KeepForReuse, ADecodeStepIsKeptWhatCouldHoldMuchMemoryIsNot) {
  const ReceivedAppendBatch step = Received(DecodeStepByReference(256, 14));
  EXPECT_LT(step.wire_bytes, 16u * 1024);
  EXPECT_TRUE(KeepForReuse(step));
  EXPECT_TRUE(KeepForReuse(Received(DecodeStepByReference(256, 40))));  // vLLM-length ids
  const ReceivedAppendBatch big = Received(DecodeStepByReference(256, 200));
  EXPECT_GT(big.wire_bytes, kReuseMaxBytes);
  EXPECT_FALSE(KeepForReuse(big));
  v1::AppendBatchRequest empties;  // 3,000 empty entries: 6 KB on the wire
  for (int i = 0; i < 3000; ++i) empties.add_sequences();
  const ReceivedAppendBatch many = Received(empties);
  EXPECT_LT(many.wire_bytes, kReuseMaxBytes);
  EXPECT_FALSE(KeepForReuse(many));
  v1::AppendBatchRequest nested;  // 100 sequences x 30 empty layers: 3,100 entries
  for (int i = 0; i < 100; ++i) {
    v1::SequenceRows* s = nested.add_sequences();
    for (int l = 0; l < 30; ++l) s->add_layers();
  }
  EXPECT_FALSE(KeepForReuse(Received(nested)));
  const ReceivedAppendBatch apart = Received(Batch(2, 2, 4), /*split_min_bytes=*/0);
  ASSERT_TRUE(apart.taken_apart);
  EXPECT_FALSE(KeepForReuse(apart));
}

}  // namespace
}  // namespace mlakv::server
