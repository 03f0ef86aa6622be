// What tests/server/rpc/append_wire_test.cc and the append_wire fuzzer
// check: ParseAppendMessage and ParseAppendBatchMessage
// (server/rpc/append_wire.h) over `slices` agree with protobuf's plain parse
// of the same bytes, accepting and refusing the same messages and, with the
// rows put back, giving the same one.
#pragma once

#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/impl/codegen/proto_utils.h>

#include <string>
#include <vector>

#include "server/rpc/append_wire.h"

namespace mlakv::server::testing {

struct WireVerdict {
  bool plain_ok = false;      // protobuf parsed it
  bool split_ok = false;      // ParseAppendMessage did
  bool took_apart = false;    // ... leaving the rows in the slices
  bool same = false;          // both parsed and agree (with the rows put back)
  std::string difference;
};

inline std::string Join(const BytePieces& pieces) {
  std::string out;
  pieces.ForEach(0, pieces.size(), [&](const char* d, size_t n) { out.append(d, n); });
  return out;
}

// The same bytes when serialized again: every field, unknown ones and the
// bit patterns of floats included (a NaN scale is not equal to itself, so
// a field-by-field comparison would call two identical parses different;
// found by the fuzzer). The differences, for a message, when not.
inline void CompareSerialized(const google::protobuf::Message& plain, const google::protobuf::Message& rebuilt,
                              WireVerdict* v) {
  v->same = plain.SerializeAsString() == rebuilt.SerializeAsString();
  if (!v->same) {
    google::protobuf::util::MessageDifferencer differencer;
    differencer.ReportDifferencesToString(&v->difference);
    differencer.Compare(plain, rebuilt);
    if (v->difference.empty()) v->difference = "unknown fields differ";
  }
}

inline WireVerdict CompareWithPlainParse(const std::vector<grpc::Slice>& slices) {
  WireVerdict v;
  grpc::ByteBuffer plain_buffer(slices.data(), slices.size());
  v1::AppendRequest plain;
  v.plain_ok = grpc::SerializationTraits<v1::AppendRequest>::Deserialize(&plain_buffer, &plain).ok();
  grpc::ByteBuffer raw(slices.data(), slices.size());
  ReceivedAppend received;
  v.split_ok = ParseAppendMessage(&raw, &received);
  v.took_apart = v.split_ok && !received.rows.empty();
  if (!v.plain_ok || !v.split_ok) return v;
  v1::AppendRequest rebuilt = received.message;
  for (size_t i = 0; i < received.rows.size(); ++i) {
    if (!rebuilt.layers(static_cast<int>(i)).ckv().empty() || !rebuilt.layers(static_cast<int>(i)).kpe().empty()) {
      v.difference = "a layer taken apart kept bytes in the message";
      return v;
    }
    rebuilt.mutable_layers(static_cast<int>(i))->set_ckv(Join(received.rows[i].ckv));
    rebuilt.mutable_layers(static_cast<int>(i))->set_kpe(Join(received.rows[i].kpe));
  }
  CompareSerialized(plain, rebuilt, &v);
  return v;
}

// The same for an AppendBatch request (ParseAppendBatchMessage): both
// parses agree, and the rows taken apart (batch_layers' and every
// sequence's layers') put back give the plain parse's message.
inline WireVerdict CompareBatchWithPlainParse(const std::vector<grpc::Slice>& slices, size_t split_min_bytes = 0) {
  WireVerdict v;
  grpc::ByteBuffer plain_buffer(slices.data(), slices.size());
  v1::AppendBatchRequest plain;
  v.plain_ok = grpc::SerializationTraits<v1::AppendBatchRequest>::Deserialize(&plain_buffer, &plain).ok();
  grpc::ByteBuffer raw(slices.data(), slices.size());
  const size_t wire_bytes = raw.Length();
  ReceivedAppendBatch received;
  v.split_ok = ParseAppendBatchMessage(&raw, &received, split_min_bytes);
  v.took_apart = v.split_ok && received.taken_apart;
  if (!v.plain_ok || !v.split_ok) return v;
  if (received.wire_bytes != wire_bytes) {
    v.difference = "wire_bytes is not the request's size";
    return v;
  }
  v1::AppendBatchRequest rebuilt = received.message;
  auto put_back = [&](v1::LayerRows* layer, const LayerPieces& rows) {
    if (!layer->ckv().empty() || !layer->kpe().empty()) {
      v.difference = "a layer taken apart kept bytes in the message";
      return false;
    }
    layer->set_ckv(Join(rows.ckv));
    layer->set_kpe(Join(rows.kpe));
    return true;
  };
  if (received.taken_apart) {
    if (received.batch_rows.size() != static_cast<size_t>(rebuilt.batch_layers_size()) ||
        received.sequence_rows.size() != static_cast<size_t>(rebuilt.sequences_size())) {
      v.difference = "pieces for another number of entries";
      return v;
    }
    for (int k = 0; k < rebuilt.batch_layers_size(); ++k) {
      if (!put_back(rebuilt.mutable_batch_layers(k), *received.batch_pieces(k))) return v;
    }
    for (int i = 0; i < rebuilt.sequences_size(); ++i) {
      const std::span<const LayerPieces> rows = received.sequence_pieces(i);
      if (rows.empty()) continue;  // a small entry left whole
      if (rows.size() != static_cast<size_t>(rebuilt.sequences(i).layers_size())) {
        v.difference = "a sequence's pieces for another number of layers";
        return v;
      }
      for (int j = 0; j < rebuilt.sequences(i).layers_size(); ++j) {
        if (!put_back(rebuilt.mutable_sequences(i)->mutable_layers(j), rows[j])) return v;
      }
    }
  } else if (received.batch_pieces(0) != nullptr || !received.sequence_pieces(0).empty()) {
    v.difference = "pieces offered for a request parsed the plain way";
    return v;
  }
  CompareSerialized(plain, rebuilt, &v);
  return v;
}

// `bytes` cut into slices at `cuts` (offsets, ascending, within bytes).
inline std::vector<grpc::Slice> CutInto(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t begin = 0;
  for (size_t cut : cuts) {
    slices.emplace_back(bytes.data() + begin, cut - begin);
    begin = cut;
  }
  slices.emplace_back(bytes.data() + begin, bytes.size() - begin);
  return slices;
}

}  // namespace mlakv::server::testing
