#include "server/rpc/append_wire.h"

#include <grpcpp/impl/codegen/proto_utils.h>

#include <cstdint>
#include <cstring>
#include <string_view>

namespace mlakv::server {
namespace {

constexpr uint32_t kLayersField = v1::AppendRequest::kLayersFieldNumber;
constexpr uint32_t kBatchSequencesField = v1::AppendBatchRequest::kSequencesFieldNumber;
constexpr uint32_t kBatchLayersField = v1::AppendBatchRequest::kBatchLayersFieldNumber;
constexpr uint32_t kSequenceLayersField = v1::SequenceRows::kLayersFieldNumber;
// A sequences entry shorter than this is copied whole into what protobuf
// parses (its rows, if any, with it): taking apart each of a decode step's
// 256 small entries field by field costs more than the copy saves.
constexpr uint64_t kSplitSequenceMinBytes = 1024;
constexpr uint32_t kCkvField = v1::LayerRows::kCkvFieldNumber;
constexpr uint32_t kKpeField = v1::LayerRows::kKpeFieldNumber;
constexpr uint64_t kMaxLength = INT32_MAX - 16;
enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

// Reads the bytes of a list of slices in order, as one run.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    for (const grpc::Slice& s : slices) remaining_ += s.size();
    SkipEmpty();
  }

  uint64_t remaining() const { return remaining_; }

  bool ReadByte(uint8_t* b) {
    if (remaining_ == 0) return false;
    *b = slices_[index_].begin()[offset_];
    Advance(1);
    return true;
  }

  // A base-128 varint of at most `max_bytes` bytes: 10 for a value, 5 for a
  // tag or a length (protobuf's parser refuses longer ones there, so this
  // reading must not accept them).
  bool ReadVarint(uint64_t* value, int max_bytes = 10) {
    uint64_t v = 0;
    for (int shift = 0; shift < 7 * max_bytes; shift += 7) {
      uint8_t b = 0;
      if (!ReadByte(&b)) return false;
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) {
        *value = v;
        return true;
      }
    }
    return false;
  }

  // The next n bytes, as pieces of the slices (no copy).
  bool Take(uint64_t n, BytePieces* pieces) {
    return Consume(n, [&](const char* data, size_t k) { pieces->Add(std::string_view(data, k)); });
  }

  // The next n bytes, appended to `out`.
  bool CopyTo(uint64_t n, std::string* out) {
    return Consume(n, [&](const char* data, size_t k) { out->append(data, k); });
  }

 private:
  template <typename Fn>
  bool Consume(uint64_t n, Fn&& fn) {
    if (n > remaining_) return false;
    while (n > 0) {
      const grpc::Slice& s = slices_[index_];
      const size_t k = static_cast<size_t>(std::min<uint64_t>(n, s.size() - offset_));
      fn(reinterpret_cast<const char*>(s.begin()) + offset_, k);
      Advance(k);
      n -= k;
    }
    return true;
  }

  void Advance(size_t n) {
    offset_ += n;
    remaining_ -= n;
    if (offset_ == slices_[index_].size()) {
      ++index_;
      offset_ = 0;
      SkipEmpty();
    }
  }

  void SkipEmpty() {
    while (index_ < slices_.size() && slices_[index_].size() == 0) ++index_;
  }

  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;
  size_t offset_ = 0;
  uint64_t remaining_ = 0;
};

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// One field of a message whose body ends `end` bytes before the reader's
// end: its tag, and its value copied to `out` unless `take` claims it (a
// length-delimited field the caller handles itself: take(field, length)).
template <typename Take>
bool CopyField(SliceReader& r, uint64_t end, std::string* out, Take&& take) {
  uint64_t tag = 0;
  if (!r.ReadVarint(&tag, 5) || tag > UINT32_MAX || (tag >> 3) == 0) return false;
  const uint32_t field = static_cast<uint32_t>(tag >> 3);
  switch (static_cast<uint32_t>(tag & 7)) {
    case kVarint: {
      uint64_t v = 0;
      if (!r.ReadVarint(&v)) return false;
      PutVarint(tag, out);
      PutVarint(v, out);
      break;
    }
    case kFixed64:
    case kFixed32:
      PutVarint(tag, out);
      if (!r.CopyTo((tag & 7) == kFixed64 ? 8 : 4, out)) return false;
      break;
    case kLengthDelimited: {
      uint64_t n = 0;
      // Protobuf takes lengths of at most 5 bytes and below INT_MAX - 16.
      if (!r.ReadVarint(&n, 5) || n > kMaxLength || n > r.remaining() - end) return false;
      bool handled = false;
      if (!take(field, n, &handled)) return false;
      if (!handled) {
        PutVarint(tag, out);
        PutVarint(n, out);
        if (!r.CopyTo(n, out)) return false;
      }
      break;
    }
    default:  // groups (3, 4) and the unused types: left to protobuf
      return false;
  }
  return r.remaining() >= end;
}

// A LayerRows of `n` bytes: its fields but ckv and kpe into `out`, those two
// into `rows` (the last of each wins, as in protobuf's parse).
bool SplitLayer(SliceReader& r, uint64_t n, std::string* out, LayerPieces* rows) {
  const uint64_t end = r.remaining() - n;
  while (r.remaining() > end) {
    const bool ok = CopyField(r, end, out, [&](uint32_t field, uint64_t len, bool* handled) {
      if (field != kCkvField && field != kKpeField) return true;
      *handled = true;
      BytePieces& pieces = field == kCkvField ? rows->ckv : rows->kpe;
      pieces = BytePieces();
      return r.Take(len, &pieces);
    });
    if (!ok) return false;
  }
  return r.remaining() == end;
}

// An embedded message field whose body was rebuilt into `body`.
void PutMessageField(uint32_t field, const std::string& body, std::string* out) {
  PutVarint(uint64_t{field} << 3 | kLengthDelimited, out);
  PutVarint(body.size(), out);
  *out += body;
}

// The fields of a message from the reader's position to `end` bytes before
// its end (an AppendRequest: end 0; a SequenceRows entry) into `out`, each
// `layers_field` entry rebuilt without its rows, which go to `rows` (one per
// entry, in order).
bool SplitLayersOf(SliceReader& r, uint64_t end, uint32_t layers_field, std::string* out,
                   std::vector<LayerPieces>* rows) {
  std::string layer;
  while (r.remaining() > end) {
    const bool ok = CopyField(r, end, out, [&](uint32_t field, uint64_t len, bool* handled) {
      if (field != layers_field) return true;
      *handled = true;
      layer.clear();
      if (!SplitLayer(r, len, &layer, &rows->emplace_back())) return false;
      PutMessageField(layers_field, layer, out);
      return true;
    });
    if (!ok) return false;
  }
  return r.remaining() == end;
}

// `slices` parsed the plain way into `message` (which then holds the rows).
template <class Message>
bool ParsePlain(const std::vector<grpc::Slice>& slices, Message* message) {
  grpc::ByteBuffer whole(slices.data(), slices.size());
  return grpc::SerializationTraits<Message>::Deserialize(&whole, message).ok();
}

}  // namespace

bool ParseLeavingRows(const std::vector<grpc::Slice>& slices, v1::AppendRequest* message,
                      std::vector<LayerPieces>* rows) {
  rows->clear();
  SliceReader r(slices);
  std::string stripped;
  stripped.reserve(256);
  return SplitLayersOf(r, 0, kLayersField, &stripped, rows) && message->ParseFromString(stripped) &&
         message->layers_size() == static_cast<int>(rows->size());
}

bool ParseAppendMessage(grpc::ByteBuffer* raw, ReceivedAppend* out) {
  out->Clear();
  if (!raw->Dump(&out->slices).ok()) return false;
  raw->Clear();
  if (ParseLeavingRows(out->slices, &out->message, &out->rows)) return true;
  // Not taken apart: the plain parse decides (and then holds the rows itself).
  const std::vector<grpc::Slice> slices = std::move(out->slices);
  out->Clear();
  return ParsePlain(slices, &out->message);
}

bool ParseBatchLeavingRows(const std::vector<grpc::Slice>& slices, v1::AppendBatchRequest* message,
                           std::vector<LayerPieces>* batch_rows, std::vector<std::vector<LayerPieces>>* sequence_rows) {
  batch_rows->clear();
  sequence_rows->clear();
  SliceReader r(slices);
  std::string stripped, part;
  stripped.reserve(1024);
  while (r.remaining() > 0) {
    const bool ok = CopyField(r, 0, &stripped, [&](uint32_t field, uint64_t len, bool* handled) {
      if (field == kBatchSequencesField && len < kSplitSequenceMinBytes) {
        sequence_rows->emplace_back();  // copied whole: any rows it has stay in the message
        return true;
      }
      if (field != kBatchLayersField && field != kBatchSequencesField) return true;
      *handled = true;
      part.clear();
      const bool split =
          field == kBatchLayersField
              ? SplitLayer(r, len, &part, &batch_rows->emplace_back())
              : SplitLayersOf(r, r.remaining() - len, kSequenceLayersField, &part, &sequence_rows->emplace_back());
      if (!split) return false;
      PutMessageField(field, part, &stripped);
      return true;
    });
    if (!ok) return false;
  }
  if (!message->ParseFromString(stripped) || message->batch_layers_size() != static_cast<int>(batch_rows->size()) ||
      message->sequences_size() != static_cast<int>(sequence_rows->size())) {
    return false;
  }
  for (int i = 0; i < message->sequences_size(); ++i) {
    const size_t split = (*sequence_rows)[i].size();  // 0: left whole (or no layers)
    if (split != 0 && static_cast<int>(split) != message->sequences(i).layers_size()) return false;
  }
  return true;
}

bool ParseAppendBatchMessage(grpc::ByteBuffer* raw, ReceivedAppendBatch* out, size_t split_min_bytes) {
  out->Clear();
  out->wire_bytes = raw->Length();
  if (out->wire_bytes < split_min_bytes) {
    // Small (a decode step by reference is ~9 KB): protobuf's parse alone
    // is faster than the reading that takes rows apart plus a parse of the
    // rest, and the few rows it may carry are cheap to copy.
    return grpc::SerializationTraits<v1::AppendBatchRequest>::Deserialize(raw, &out->message).ok();
  }
  if (!raw->Dump(&out->slices).ok()) return false;
  raw->Clear();
  if (ParseBatchLeavingRows(out->slices, &out->message, &out->batch_rows, &out->sequence_rows)) {
    out->taken_apart = true;
    return true;
  }
  // Not taken apart: the plain parse decides (and then holds the rows itself).
  const size_t wire_bytes = out->wire_bytes;
  const std::vector<grpc::Slice> slices = std::move(out->slices);
  out->Clear();
  out->wire_bytes = wire_bytes;
  return ParsePlain(slices, &out->message);
}

bool KeepForReuse(const ReceivedAppendBatch& r) {
  if (r.wire_bytes > kReuseMaxBytes || r.taken_apart) return false;
  const v1::AppendBatchRequest& m = r.message;
  int entries = m.sequences_size() + m.batch_layers_size();
  for (const v1::SequenceRows& s : m.sequences()) {
    entries += s.layers_size() + s.block_hashes_size();
    if (entries > kReuseMaxEntries) return false;
  }
  return entries <= kReuseMaxEntries;
}

}  // namespace mlakv::server
