#include "client/append_wire.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/support/slice.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace mlakv {
namespace {

using google::protobuf::io::CodedOutputStream;
using google::protobuf::internal::WireFormatLite;

constexpr int kLayersField = v1::AppendRequest::kLayersFieldNumber;
constexpr int kCkvField = v1::LayerRows::kCkvFieldNumber;
constexpr int kKpeField = v1::LayerRows::kKpeFieldNumber;
constexpr size_t kMaxPrefix = 5 + 10;  // a tag and a 64-bit length, at most

// Bytes of a length-delimited field of `n` bytes (an empty one is left out,
// as proto3 leaves out an empty bytes field).
size_t BytesFieldSize(int field, size_t n) {
  if (n == 0) return 0;
  return WireFormatLite::TagSize(field, WireFormatLite::TYPE_BYTES) +
         CodedOutputStream::VarintSize64(static_cast<uint64_t>(n)) + n;
}

// Bytes of an embedded message field of `n` bytes (written even when empty:
// a repeated entry).
size_t MessageFieldSize(int field, size_t n) {
  return WireFormatLite::TagSize(field, WireFormatLite::TYPE_MESSAGE) +
         CodedOutputStream::VarintSize64(static_cast<uint64_t>(n)) + n;
}

uint8_t* WriteLengthPrefix(int field, size_t n, uint8_t* out) {
  out = WireFormatLite::WriteTagToArray(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, out);
  return CodedOutputStream::WriteVarint64ToArray(static_cast<uint64_t>(n), out);
}

uint8_t* WriteBytesField(int field, std::string_view bytes, uint8_t* out) {
  if (bytes.empty()) return out;
  out = WriteLengthPrefix(field, bytes.size(), out);
  std::memcpy(out, bytes.data(), bytes.size());
  return out + bytes.size();
}

// The bytes of a message as slices: small parts written into a buffer of
// our own, the rows' bytes referenced where they are (each reference slice
// holding a copy of the owner).
class SliceWriter {
 public:
  explicit SliceWriter(const std::shared_ptr<const void>& owner) : owner_(owner) {}

  // Room for `n` small bytes; returns where to write them.
  uint8_t* Small(size_t n) {
    const size_t at = pending_.size();
    pending_.resize(at + n);
    return reinterpret_cast<uint8_t*>(pending_.data() + at);
  }
  void TrimSmall(const uint8_t* end) { pending_.resize(end - reinterpret_cast<const uint8_t*>(pending_.data())); }

  void Reference(std::string_view bytes) {
    if (bytes.empty()) return;
    Flush();
    auto* hold = new std::shared_ptr<const void>(owner_);
    slices_.emplace_back(const_cast<char*>(bytes.data()), bytes.size(), &Release, hold);
  }

  grpc::ByteBuffer Finish() {
    Flush();
    return grpc::ByteBuffer(slices_.data(), slices_.size());
  }

 private:
  static void Release(void* hold) { delete static_cast<std::shared_ptr<const void>*>(hold); }
  void Flush() {
    if (pending_.empty()) return;
    slices_.emplace_back(pending_.data(), pending_.size());  // copied: a few bytes
    pending_.clear();
  }

  const std::shared_ptr<const void>& owner_;
  std::string pending_;
  std::vector<grpc::Slice> slices_;
};

// What protobuf writes, as slices: into blocks of our own, except what it
// writes aliased (WriteAliasedRaw: with aliasing enabled, a string or bytes
// field that does not fit the room left in the current block), which becomes
// a slice of the caller's bytes holding a copy of the owner.
class AliasingSliceStream final : public google::protobuf::io::ZeroCopyOutputStream {
 public:
  explicit AliasingSliceStream(const std::shared_ptr<const void>& owner) : owner_(owner) {}

  bool Next(void** data, int* size) override {
    CloseBlock();
    block_ = grpc::Slice(kBlockBytes);
    used_ = kBlockBytes;
    *data = const_cast<uint8_t*>(block_.begin());  // ours until it is sent
    *size = static_cast<int>(kBlockBytes);
    bytes_ += kBlockBytes;
    return true;
  }
  void BackUp(int count) override {
    used_ -= static_cast<size_t>(count);
    bytes_ -= count;
  }
  int64_t ByteCount() const override { return bytes_; }
  bool AllowsAliasing() const override { return true; }
  bool WriteAliasedRaw(const void* data, int size) override {
    CloseBlock();
    if (size > 0) {
      auto* hold = new std::shared_ptr<const void>(owner_);
      slices_.emplace_back(const_cast<void*>(data), static_cast<size_t>(size), &Release, hold);
      bytes_ += size;
    }
    return true;
  }

  // After the CodedOutputStream over this one is gone (it backs up what it
  // did not use when destroyed).
  grpc::ByteBuffer Finish() {
    CloseBlock();
    return grpc::ByteBuffer(slices_.data(), slices_.size());
  }

 private:
  static constexpr size_t kBlockBytes = 8192;
  static void Release(void* hold) { delete static_cast<std::shared_ptr<const void>*>(hold); }
  void CloseBlock() {
    if (used_ > 0) slices_.push_back(block_.sub(0, used_));
    block_ = grpc::Slice();
    used_ = 0;
  }

  const std::shared_ptr<const void>& owner_;
  grpc::Slice block_;
  size_t used_ = 0;  // bytes of block_ written (or handed out and not backed up)
  int64_t bytes_ = 0;
  std::vector<grpc::Slice> slices_;
};

}  // namespace

grpc::ByteBuffer SerializeReferencingBytes(const google::protobuf::MessageLite& message,
                                           const std::shared_ptr<const void>& owner) {
  message.ByteSizeLong();  // caches the sizes SerializeWithCachedSizes writes
  AliasingSliceStream stream(owner);
  {
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.EnableAliasing(true);
    message.SerializeWithCachedSizes(&coded);
  }
  return stream.Finish();
}

absl::StatusOr<grpc::ByteBuffer> SerializeAppendRequest(const v1::AppendRequest& head,
                                                        std::span<const LayerRowBytes> rows,
                                                        const std::shared_ptr<const void>& rows_owner) {
  if (rows.size() != static_cast<size_t>(head.layers_size())) {
    return absl::InternalError(absl::StrCat("append: ", rows.size(), " row sets for ", head.layers_size(), " layers"));
  }
  v1::AppendRequest top = head;
  top.clear_layers();
  size_t total = top.ByteSizeLong();  // caches the sizes SerializeWithCachedSizesToArray uses
  std::vector<size_t> layer_sizes(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const v1::LayerRows& layer = head.layers(static_cast<int>(i));
    if (!layer.ckv().empty() || !layer.kpe().empty()) {
      return absl::InternalError("append: a layer entry of the head carries rows; they go in `rows`");
    }
    layer_sizes[i] =
        layer.ByteSizeLong() + BytesFieldSize(kCkvField, rows[i].ckv.size()) + BytesFieldSize(kKpeField, rows[i].kpe.size());
    total += MessageFieldSize(kLayersField, layer_sizes[i]);
  }
  if (rows_owner != nullptr) {
    // By reference: every small part into the writer's own buffer, the rows
    // as slices of their own. Sizes were computed (and cached) above.
    SliceWriter w(rows_owner);
    w.TrimSmall(top.SerializeWithCachedSizesToArray(w.Small(top.GetCachedSize())));
    for (size_t i = 0; i < rows.size(); ++i) {
      const v1::LayerRows& layer = head.layers(static_cast<int>(i));
      uint8_t* out = WriteLengthPrefix(kLayersField, layer_sizes[i], w.Small(kMaxPrefix + layer.GetCachedSize()));
      w.TrimSmall(layer.SerializeWithCachedSizesToArray(out));
      for (const bool ckv : {true, false}) {
        const std::string_view bytes = ckv ? rows[i].ckv : rows[i].kpe;
        if (bytes.empty()) continue;
        w.TrimSmall(WriteLengthPrefix(ckv ? kCkvField : kKpeField, bytes.size(), w.Small(kMaxPrefix)));
        w.Reference(bytes);
      }
    }
    grpc::ByteBuffer out = w.Finish();
    if (out.Length() != total) {
      return absl::InternalError(absl::StrCat("append: serialized ", out.Length(), " bytes, sized ", total));
    }
    return out;
  }
  grpc::Slice slice(total);
  uint8_t* const begin = const_cast<uint8_t*>(slice.begin());  // ours until it is sent
  uint8_t* out = top.SerializeWithCachedSizesToArray(begin);
  for (size_t i = 0; i < rows.size(); ++i) {
    out = WriteLengthPrefix(kLayersField, layer_sizes[i], out);
    out = head.layers(static_cast<int>(i)).SerializeWithCachedSizesToArray(out);
    out = WriteBytesField(kCkvField, rows[i].ckv, out);
    out = WriteBytesField(kKpeField, rows[i].kpe, out);
  }
  if (static_cast<size_t>(out - begin) != total) {
    return absl::InternalError(absl::StrCat("append: serialized ", out - begin, " bytes, sized ", total));
  }
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace mlakv
