#include "server/rpc/append_wire.h"

#include <grpcpp/impl/codegen/proto_utils.h>

#include <cstdint>
#include <cstring>
#include <string_view>

namespace mlakv::server {
namespace {

constexpr uint32_t kLayersField = v1::AppendRequest::kLayersFieldNumber;
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

}  // namespace

bool ParseLeavingRows(const std::vector<grpc::Slice>& slices, v1::AppendRequest* message,
                      std::vector<LayerPieces>* rows) {
  rows->clear();
  SliceReader r(slices);
  std::string stripped, layer;
  stripped.reserve(256);
  while (r.remaining() > 0) {
    const bool ok = CopyField(r, 0, &stripped, [&](uint32_t field, uint64_t len, bool* handled) {
      if (field != kLayersField) return true;
      *handled = true;
      layer.clear();
      if (!SplitLayer(r, len, &layer, &rows->emplace_back())) return false;
      PutVarint(uint64_t{kLayersField} << 3 | kLengthDelimited, &stripped);
      PutVarint(layer.size(), &stripped);
      stripped += layer;
      return true;
    });
    if (!ok) return false;
  }
  return message->ParseFromString(stripped) && message->layers_size() == static_cast<int>(rows->size());
}

bool ParseAppendMessage(grpc::ByteBuffer* raw, ReceivedAppend* out) {
  out->Clear();
  if (!raw->Dump(&out->slices).ok()) return false;
  raw->Clear();
  if (ParseLeavingRows(out->slices, &out->message, &out->rows)) return true;
  // Not taken apart: the plain parse decides (and then holds the rows itself).
  out->rows.clear();
  out->message.Clear();
  grpc::ByteBuffer whole(out->slices.data(), out->slices.size());
  out->slices.clear();
  return grpc::SerializationTraits<v1::AppendRequest>::Deserialize(&whole, &out->message).ok();
}

}  // namespace mlakv::server
