// SerializeAppendRequest (client/append_wire.h) writes the rows after each
// layer's other fields and copies them once; whatever it writes must parse
// back to exactly the AppendRequest the plain way would send: the same
// fields, the same rows, nothing unknown. Checked for a message with every
// field set, rows around the varint length boundaries, empty row fields,
// region references, zero layers, and random shapes; and that a head that
// breaks the function's contract is refused rather than written wrongly.
// SerializeReferencingBytes (any message, large bytes fields referenced)
// must write exactly protobuf's own bytes, reference the large fields where
// they are, and hold its owner until gRPC lets the slices go.
#include "client/append_wire.h"

#include <google/protobuf/util/message_differencer.h>

#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"

namespace mlakv {
namespace {

// What the plain way sends: the head with the rows in its bytes fields.
v1::AppendRequest Plain(v1::AppendRequest head, const std::vector<LayerRowBytes>& rows) {
  for (int i = 0; i < head.layers_size(); ++i) {
    head.mutable_layers(i)->set_ckv(std::string(rows[i].ckv));
    head.mutable_layers(i)->set_kpe(std::string(rows[i].kpe));
  }
  return head;
}

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// Serializes (rows copied, and rows by reference), checks the size against
// protobuf's own, parses back and compares field by field.
void ExpectRoundTripOnce(const v1::AppendRequest& head, const std::vector<LayerRowBytes>& rows,
                         const std::shared_ptr<const void>& owner);

void ExpectRoundTrip(const v1::AppendRequest& head, const std::vector<LayerRowBytes>& rows) {
  ExpectRoundTripOnce(head, rows, nullptr);
  auto owner = std::make_shared<int>(0);
  ExpectRoundTripOnce(head, rows, owner);
  EXPECT_EQ(owner.use_count(), 1) << "every reference slice gave its owner back";
}

void ExpectRoundTripOnce(const v1::AppendRequest& head, const std::vector<LayerRowBytes>& rows,
                         const std::shared_ptr<const void>& owner) {
  SCOPED_TRACE(owner ? "rows by reference" : "rows copied");
  absl::StatusOr<grpc::ByteBuffer> wire = SerializeAppendRequest(head, rows, owner);
  ASSERT_TRUE(wire.ok()) << wire.status();
  const v1::AppendRequest want = Plain(head, rows);
  const std::string bytes = Flatten(*wire);
  EXPECT_EQ(bytes.size(), want.ByteSizeLong()) << "the same fields, only in another order";
  v1::AppendRequest got;
  ASSERT_TRUE(got.ParseFromString(bytes));
  std::string diff;
  google::protobuf::util::MessageDifferencer differencer;
  differencer.ReportDifferencesToString(&diff);
  EXPECT_TRUE(differencer.Compare(want, got)) << diff;
  EXPECT_TRUE(got.GetReflection()->GetUnknownFields(got).empty());
  for (int i = 0; i < got.layers_size(); ++i) {
    EXPECT_TRUE(got.layers(i).GetReflection()->GetUnknownFields(got.layers(i)).empty());
  }
}

std::string Bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

TEST(SerializeAppendRequest, EveryFieldSetParsesBackTheSame) {
  v1::AppendRequest head;
  head.set_pool("pool-a");
  head.set_sequence("req-17");
  head.set_start(4096);
  head.set_row_count(3);
  head.set_dtype(v1::ROW_DTYPE_FLOAT16);
  head.set_reserve_tokens(8192);
  head.set_expect_length(4096);
  head.set_view(v1::SEQUENCE_VIEW_BASIC);
  head.set_expect_generation(99);
  head.add_block_hashes("h0");
  head.add_block_hashes(std::string(64, 'x'));
  head.set_block_hashes_first_page(3);
  head.set_pin(true);
  std::vector<LayerRowBytes> rows;
  std::vector<std::string> keep;
  for (int l = 0; l < 3; ++l) {
    v1::LayerRows* layer = head.add_layers();
    layer->set_layer(60 - l);
    layer->set_ckv_scale(0.25f + l);
    layer->set_kpe_scale(0.5f);
    keep.push_back(Bytes(3 * 1024, 2 * l));
    keep.push_back(Bytes(3 * 128, 2 * l + 1));
  }
  for (int l = 0; l < 3; ++l) rows.push_back({keep[2 * l], keep[2 * l + 1]});
  ExpectRoundTrip(head, rows);
}

TEST(SerializeAppendRequest, RowLengthsAcrossVarintBoundaries) {
  // 127/128 and 16383/16384 bytes change the length prefix from 1 to 2 and 2
  // to 3 bytes; 2,097,152 to 4 bytes; 4,128,768 is `mlakv bench`'s message.
  for (size_t n : {1ul, 127ul, 128ul, 16383ul, 16384ul, 2097151ul, 2097152ul, 4128768ul}) {
    SCOPED_TRACE(n);
    v1::AppendRequest head;
    head.set_sequence("s");
    head.add_layers()->set_layer(1);
    const std::string ckv = Bytes(n, n), kpe = Bytes(n / 8 + 1, n + 1);
    ExpectRoundTrip(head, {{ckv, kpe}});
  }
}

TEST(SerializeAppendRequest, EmptyRowsRegionReferencesAndNoLayers) {
  v1::AppendRequest head;
  head.set_sequence("refs");
  head.set_row_count(2);
  v1::LayerRows* by_ref = head.add_layers();  // rows from regions: no bytes at all
  by_ref->set_layer(0);
  by_ref->mutable_ckv_ref()->set_region("r");
  by_ref->mutable_ckv_ref()->set_offset(1 << 20);
  by_ref->mutable_kpe_ref()->set_region("r");
  by_ref->mutable_kpe_ref()->set_row_stride_bytes(256);
  head.add_layers();  // an entry with every field at its default: still an entry
  v1::LayerRows* half = head.add_layers();  // ckv bytes, kpe by reference
  half->set_layer(2);
  half->mutable_kpe_ref()->set_region("k");
  const std::string ckv = Bytes(2048, 5);
  ExpectRoundTrip(head, {{}, {}, {ckv, {}}});

  v1::AppendRequest none;  // a message of no layers (creates a sequence, reserves)
  none.set_sequence("empty");
  none.set_reserve_tokens(64);
  ExpectRoundTrip(none, {});
}

TEST(SerializeAppendRequest, RandomShapes) {
  std::mt19937_64 rng(42);
  for (int trial = 0; trial < 200; ++trial) {
    SCOPED_TRACE(trial);
    v1::AppendRequest head;
    if (rng() % 2) head.set_pool("p" + std::to_string(rng() % 100));
    head.set_sequence("seq" + std::to_string(trial));
    head.set_start(static_cast<uint32_t>(rng()));
    head.set_row_count(static_cast<uint32_t>(rng() % 5000));
    if (rng() % 2) head.set_expect_length(static_cast<uint32_t>(rng()));
    const int layers = static_cast<int>(rng() % 6);
    std::vector<std::string> keep;
    for (int l = 0; l < layers; ++l) {
      v1::LayerRows* layer = head.add_layers();
      layer->set_layer(static_cast<uint32_t>(rng() % 61));
      if (rng() % 2) layer->set_ckv_scale(static_cast<float>(rng() % 1000) / 7.0f);
      keep.push_back(Bytes(rng() % 3 == 0 ? 0 : rng() % 40000, rng()));
      keep.push_back(Bytes(rng() % 3 == 0 ? 0 : rng() % 5000, rng()));
    }
    std::vector<LayerRowBytes> rows;
    for (int l = 0; l < layers; ++l) rows.push_back({keep[2 * l], keep[2 * l + 1]});
    ExpectRoundTrip(head, rows);
  }
}

TEST(SerializeAppendRequest, RowsByReferenceAreTheCallersBytesHeldUntilGrpcLetsGo) {
  v1::AppendRequest head;
  head.set_sequence("s");
  head.add_layers()->set_layer(0);
  head.add_layers()->set_layer(1);
  const std::string ckv0 = Bytes(5000, 1), kpe0 = Bytes(600, 2), ckv1 = Bytes(70000, 3), kpe1 = Bytes(1, 4);
  const std::vector<LayerRowBytes> rows = {{ckv0, kpe0}, {ckv1, kpe1}};
  auto owner = std::make_shared<int>(0);
  {
    absl::StatusOr<grpc::ByteBuffer> wire = SerializeAppendRequest(head, rows, owner);
    ASSERT_TRUE(wire.ok()) << wire.status();
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(wire->Dump(&slices).ok());
    // Every row field is one slice that is the caller's memory itself.
    for (const std::string* bytes : {&ckv0, &kpe0, &ckv1, &kpe1}) {
      int found = 0;
      for (const grpc::Slice& s : slices) {
        found += reinterpret_cast<const char*>(s.begin()) == bytes->data() && s.size() == bytes->size();
      }
      EXPECT_EQ(found, 1);
    }
    EXPECT_EQ(owner.use_count(), 1 + 4) << "one hold per row slice";
    grpc::ByteBuffer copy(*wire);  // gRPC taking its own reference
    wire->Clear();
    slices.clear();
    EXPECT_EQ(owner.use_count(), 1 + 4) << "still held by the copy";
  }
  EXPECT_EQ(owner.use_count(), 1);
}

TEST(SerializeAppendRequest, AHeadThatBreaksTheContractIsRefused) {
  v1::AppendRequest head;
  head.set_sequence("s");
  head.add_layers()->set_ckv("rows in the head");
  const std::vector<LayerRowBytes> one = {{"abcd", {}}};
  EXPECT_EQ(SerializeAppendRequest(head, one).status().code(), absl::StatusCode::kInternal);
  head.mutable_layers(0)->clear_ckv();
  EXPECT_EQ(SerializeAppendRequest(head, {}).status().code(), absl::StatusCode::kInternal);  // one row set short
  EXPECT_TRUE(SerializeAppendRequest(head, one).ok());
}

// A compact AppendBatch of `layers` entries of `rows` rows, and sequences
// with small per-sequence rows.
std::shared_ptr<v1::AppendBatchRequest> Batch(int layers, int rows, int sequences) {
  auto m = std::make_shared<v1::AppendBatchRequest>();
  m->set_pool("default");
  m->set_dtype(v1::ROW_DTYPE_BFLOAT16);
  for (int i = 0; i < sequences; ++i) {
    v1::SequenceRows* s = m->add_sequences();
    s->set_sequence("seq-" + std::to_string(i));
    s->set_row_count(1);
    s->set_start(static_cast<uint32_t>(i) * 1000);
    if (i % 3 == 2) {
      v1::LayerRows* l = s->add_layers();
      l->set_ckv(Bytes(1024, 90 + i));
      l->set_kpe(Bytes(128, 190 + i));
    }
  }
  for (int k = 0; k < layers; ++k) {
    v1::LayerRows* l = m->add_batch_layers();
    l->set_layer(k);
    l->set_ckv(Bytes(static_cast<size_t>(rows) * 1024, 10 + k));
    l->set_kpe(Bytes(static_cast<size_t>(rows) * 128, 50 + k));
    l->set_ckv_scale(0.5f);
  }
  return m;
}

TEST(SerializeReferencingBytes, WritesProtobufsOwnBytes) {
  for (const auto& [layers, rows, sequences] : std::vector<std::tuple<int, int, int>>{
           {0, 0, 0}, {1, 1, 1}, {3, 7, 5}, {61, 256, 256}, {2, 8, 0}, {0, 0, 40}, {5, 300, 3}}) {
    SCOPED_TRACE(::testing::Message() << layers << " x " << rows << ", " << sequences << " sequences");
    std::shared_ptr<v1::AppendBatchRequest> m = Batch(layers, rows, sequences);
    const grpc::ByteBuffer wire = SerializeReferencingBytes(*m, m);
    EXPECT_EQ(wire.Length(), m->ByteSizeLong());
    EXPECT_TRUE(Flatten(wire) == m->SerializeAsString()) << "the bytes differ";
  }
}

TEST(SerializeReferencingBytes, LargeFieldsAreTheCallersBytesHeldUntilGrpcLetsGo) {
  std::shared_ptr<v1::AppendBatchRequest> m = Batch(4, 256, 8);  // 256 KiB + 32 KiB per entry
  const std::shared_ptr<const void> owner = m;
  {
    const grpc::ByteBuffer wire = SerializeReferencingBytes(*m, owner);
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(wire.Dump(&slices).ok());
    for (const v1::LayerRows& l : m->batch_layers()) {
      for (const std::string* bytes : {&l.ckv(), &l.kpe()}) {
        int found = 0;
        for (const grpc::Slice& s : slices) {
          found += reinterpret_cast<const char*>(s.begin()) == bytes->data() && s.size() == bytes->size();
        }
        EXPECT_EQ(found, 1) << "a large field copied, not referenced";
      }
    }
    const long held = owner.use_count() - 2;  // less `m` and `owner`
    EXPECT_EQ(held, 8) << "one hold per referenced field";
    grpc::ByteBuffer copy(wire);  // gRPC taking its own reference
    slices.clear();
    EXPECT_EQ(owner.use_count() - 2, held);
  }
  EXPECT_EQ(owner.use_count(), 2) << "every reference slice gave its owner back";
  // The message's other fields may change once it returned: they were copied.
  const grpc::ByteBuffer wire = SerializeReferencingBytes(*m, owner);
  const std::string before = m->SerializeAsString();
  m->mutable_sequences(0)->set_start(123456);
  m->set_pool("another pool");
  v1::AppendBatchRequest sent;
  ASSERT_TRUE(sent.ParseFromString(Flatten(wire)));
  EXPECT_EQ(sent.SerializeAsString(), before);
}

}  // namespace
}  // namespace mlakv
