// An Append message serialized with each layer's rows copied once, from the
// caller's buffers straight into the message's one slice.
//
// The plain way costs two copies of every row: into the message's bytes
// fields, then into the buffer gRPC sends. Here the message's small fields
// (everything but the rows) are built and serialized by protobuf, and the
// rows' two bytes fields of each layer are written after the layer's other
// fields: protobuf parses fields in any order, so the bytes parse back to the
// same AppendRequest the plain way sends (tests/client/append_wire_test.cc
// checks field by field).
//
// Wire layout of one message (proto3):
//   [AppendRequest without `layers`]
//   per layer: tag(6, LEN) varint(n) [LayerRows without ckv, kpe]
//              tag(2, LEN) varint(|ckv|) ckv   (left out when empty)
//              tag(3, LEN) varint(|kpe|) kpe   (left out when empty)
#pragma once

#include <google/protobuf/message_lite.h>
#include <grpcpp/support/byte_buffer.h>

#include <memory>
#include <span>
#include <string_view>

#include "absl/status/statusor.h"
#include "mlakv/v1/kv_cache.pb.h"

namespace mlakv {

// The rows of one layer entry of a message: views of the caller's buffers.
struct LayerRowBytes {
  std::string_view ckv;
  std::string_view kpe;
};

// `head` with rows[i] as the ckv and kpe of head.layers(i) (whose own ckv and
// kpe must be empty); rows.size() == head.layers_size(). INTERNAL when
// either is not so (a caller's bug).
//
// With `rows_owner` set, the rows are not copied at all: the message is a
// list of slices, the rows' own bytes among them, each holding a reference
// to `rows_owner` (which must keep the rows' bytes alive and unchanged) until
// gRPC's transport has written it, which may be after the call returns (a
// cancelled call's bytes can sit in the connection's write buffer).
absl::StatusOr<grpc::ByteBuffer> SerializeAppendRequest(const v1::AppendRequest& head,
                                                        std::span<const LayerRowBytes> rows,
                                                        const std::shared_ptr<const void>& rows_owner = nullptr);

// Any message serialized by protobuf with its large bytes and string fields
// (those longer than the room left in the writer's current 8 KiB block: a
// compact AppendBatch's 61 entries of 256 rows, 295 KB each) referenced
// where they are instead of copied -- protobuf's aliasing
// (CodedOutputStream::EnableAliasing) over a stream of grpc::Slices. Every
// reference slice holds a copy of `owner`, which must keep the message's
// bytes fields alive and unchanged until gRPC's transport has written them
// (possibly after the call returns; the message's other fields may change
// once this returns: they were copied). The bytes on the wire are exactly
// message.SerializeAsString()'s (tests/client/append_wire_test.cc).
grpc::ByteBuffer SerializeReferencingBytes(const google::protobuf::MessageLite& message,
                                           const std::shared_ptr<const void>& owner);

}  // namespace mlakv
