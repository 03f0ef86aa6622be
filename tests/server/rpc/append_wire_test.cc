// ParseAppendMessage (server/rpc/append_wire.h) leaves an Append message's
// rows in the slices they arrived in, and must give exactly what protobuf's
// plain parse gives: for messages cut into slices anywhere (a varint, a tag
// or a row split between two slices), with fields in any order, a bytes
// field given twice, unknown fields, and for every truncation of a message
// and a handful of malformed ones, where both must refuse alike.
#include "server/rpc/append_wire.h"

#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/server/rpc/append_wire_check.h"

namespace mlakv::server {
namespace {

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

TEST(ParseAppendMessage, FieldsInAnyOrderRepeatedBytesAndUnknownFields) {
  // The client's order (rows after the scales), protobuf's order, a ckv
  // field given twice (the last wins), unknown fields of every wire type
  // but groups at both levels, and a layer entry with no rows.
  auto field = [](uint32_t number, uint32_t type) {
    std::string t;
    uint64_t tag = uint64_t{number} << 3 | type;
    while (tag >= 0x80) {
      t.push_back(static_cast<char>(tag | 0x80));
      tag >>= 7;
    }
    t.push_back(static_cast<char>(tag));
    return t;
  };
  auto len = [&](uint32_t number, const std::string& body) {
    std::string out = field(number, 2);
    uint64_t n = body.size();
    while (n >= 0x80) {
      out.push_back(static_cast<char>(n | 0x80));
      n >>= 7;
    }
    out.push_back(static_cast<char>(n));
    return out + body;
  };
  const std::string first = Bytes(300, 1), second = Bytes(200, 2), kpe = Bytes(50, 3);
  std::string layer = field(1, 0) + "\x05" + len(2, first) + field(4, 5) + std::string("\x00\x00\x80\x3e", 4) +
                      len(2, second) + len(3, kpe) + field(99, 0) + "\x2a" + field(98, 1) + std::string(8, 'x') +
                      len(97, "unknown bytes");
  std::string top = len(2, "seq") + len(6, layer) + field(4, 0) + "\x03" + len(6, "") + field(500, 5) + "abcd" +
                    len(6, len(3, kpe) + field(1, 0) + "\x01");
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
    if (v.plain_ok) EXPECT_TRUE(v.same) << v.difference;
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
    if (v.plain_ok) EXPECT_TRUE(v.same) << v.difference;
  }
}

}  // namespace
}  // namespace mlakv::server
