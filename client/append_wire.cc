#include "client/append_wire.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/support/slice.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace mlakv {
namespace {

using google::protobuf::io::CodedOutputStream;
using google::protobuf::internal::WireFormatLite;

constexpr int kLayersField = v1::AppendRequest::kLayersFieldNumber;
constexpr int kCkvField = v1::LayerRows::kCkvFieldNumber;
constexpr int kKpeField = v1::LayerRows::kKpeFieldNumber;

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

}  // namespace

absl::StatusOr<grpc::ByteBuffer> SerializeAppendRequest(const v1::AppendRequest& head,
                                                        std::span<const LayerRowBytes> rows) {
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
