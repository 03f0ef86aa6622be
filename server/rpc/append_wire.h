// An Append message parsed with its rows left where gRPC received them.
//
// gRPC hands the Append reactor each message as a ByteBuffer: the slices in
// which the transport received it (a 4 MB message is many). A plain protobuf
// parse copies every layer's ckv and kpe bytes out of them into strings, and
// the backend then copies those strings again (into pinned staging for the
// GPU). Here the wire format's framing is read once: each layer entry's ckv
// (field 2) and kpe (field 3) are noted as pieces of the slices, and
// everything else is re-emitted into a small message that protobuf parses as
// usual (UTF-8 checks, unknown fields, every other rule its own). The rows are
// then read straight from the slices by the backend's staging copy.
//
// Same answer as a plain parse: a message this reading does not take apart
// (malformed framing, a group, a field numbered 0) is parsed the plain way,
// which accepts or refuses it as before; a bytes field given twice keeps the
// last, as protobuf does. tests/server/rpc/append_wire_test.cc checks the two
// against each other on split, reordered and malformed messages, and
// tests/fuzz/append_wire_fuzzer.cc on arbitrary bytes.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/impl/serialization_traits.h>
#include <grpcpp/support/slice.h>
#include <grpcpp/support/status.h>

#include <span>
#include <string>
#include <vector>

#include "mlakv/v1/kv_cache.pb.h"
#include "server/backend/rows.h"

namespace mlakv::server {

// The rows of one layer entry of a message, in pieces of its slices.
struct LayerPieces {
  BytePieces ckv, kpe;
};

// A message as received, and what it parsed to.
struct ReceivedAppend {
  std::vector<grpc::Slice> slices;  // keep the pieces' bytes alive
  v1::AppendRequest message;        // the layers' ckv and kpe empty when `rows` is set
  // One per message.layers() entry, or empty when the message was parsed
  // the plain way (its rows are then in `message`).
  std::vector<LayerPieces> rows;

  void Clear() {
    slices.clear();
    rows.clear();
    message.Clear();
  }
};

// Parses `raw` (consumed: its slices move to `out`) into `out`. False when
// the bytes are not a valid AppendRequest (as protobuf's parse would say).
bool ParseAppendMessage(grpc::ByteBuffer* raw, ReceivedAppend* out);

// An AppendBatch request as received, the same way: the rows of its layer
// entries -- batch_layers (the compact form: 61 entries of a decode step's
// 256 rows each, 18 MB of bytes) and every sequence's layers -- left in the
// slices, everything else parsed by protobuf. The server's AppendBatch
// takes its request as this type (grpc::SerializationTraits below), so a
// request's rows are copied once, into the backend's staging, not twice.
struct ReceivedAppendBatch {
  std::vector<grpc::Slice> slices;  // keep the pieces' bytes alive
  v1::AppendBatchRequest message;   // rows' ckv and kpe empty where taken apart
  // Whether the rows below are set (else the plain parse holds them in
  // `message`): batch_rows[k] for message.batch_layers(k), sequence_rows[i][j]
  // for message.sequences(i).layers(j) -- or sequence_rows[i] empty when
  // that entry was small and left whole (its rows, if any, in `message`).
  bool taken_apart = false;
  std::vector<LayerPieces> batch_rows;
  std::vector<std::vector<LayerPieces>> sequence_rows;
  size_t wire_bytes = 0;  // the request's size on the wire

  void Clear() {
    slices.clear();
    message.Clear();
    taken_apart = false;
    batch_rows.clear();
    sequence_rows.clear();
    wire_bytes = 0;
  }
  // The rows of batch_layers(k) / of sequences(i).layers(), or null / empty
  // when they are in `message`.
  const LayerPieces* batch_pieces(int k) const { return taken_apart ? &batch_rows[k] : nullptr; }
  std::span<const LayerPieces> sequence_pieces(int i) const {
    return taken_apart ? std::span<const LayerPieces>(sequence_rows[i]) : std::span<const LayerPieces>();
  }
};

// Whether a finished call's request is worth keeping, cleared, for the next
// call to parse into (cq/message_recycler.h): a decode step's request (256
// sequences, ~9 KB) parses in ~12 us into a cleared message against ~15 into
// a fresh one (development VM). A cleared message keeps about the memory it
// last held -- a heap object per sub-message and string, the strings'
// capacity -- so only small ones are kept: at most kReuseMaxBytes on the
// wire and kReuseMaxEntries sub-messages and strings (a request of empty
// entries expands ~75x in memory), never one taken apart. About 0.5 MB each
// at most.
inline constexpr size_t kReuseMaxBytes = 32 * 1024;
inline constexpr int kReuseMaxEntries = 2048;
bool KeepForReuse(const ReceivedAppendBatch& r);

// Requests smaller than this are parsed the plain way.
inline constexpr size_t kSplitBatchMinBytes = 64 * 1024;

// Parses `raw` (consumed) into `out`; false when the bytes are not a valid
// AppendBatchRequest (as protobuf's parse would say). A request of fewer than
// `split_min_bytes` bytes is parsed the plain way (tests pass 0).
bool ParseAppendBatchMessage(grpc::ByteBuffer* raw, ReceivedAppendBatch* out,
                             size_t split_min_bytes = kSplitBatchMinBytes);

// The rows-out reading alone: false when it does not take the message apart
// (the caller then parses the plain way) or protobuf refuses what is left.
bool ParseBatchLeavingRows(const std::vector<grpc::Slice>& slices, v1::AppendBatchRequest* message,
                           std::vector<LayerPieces>* batch_rows, std::vector<std::vector<LayerPieces>>* sequence_rows);

// The rows-out reading alone over `slices`: false when it does not take the
// message apart (the caller then parses the plain way) or protobuf refuses
// what is left.
bool ParseLeavingRows(const std::vector<grpc::Slice>& slices, v1::AppendRequest* message,
                      std::vector<LayerPieces>* rows);

}  // namespace mlakv::server

// The server's AppendBatch request type: gRPC's completion-queue API
// deserializes a request through SerializationTraits of the type it is asked
// to fill (KvCacheAsyncService::RequestAppendBatchReceived). A request that
// does not parse is refused by gRPC as a protobuf one is (INTERNAL, before
// the handler).
template <>
class grpc::SerializationTraits<mlakv::server::ReceivedAppendBatch, void> {
 public:
  static grpc::Status Serialize(const mlakv::server::ReceivedAppendBatch&, grpc::ByteBuffer*, bool*) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "a received AppendBatch is never sent");
  }
  static grpc::Status Deserialize(grpc::ByteBuffer* buffer, mlakv::server::ReceivedAppendBatch* out) {
    if (!mlakv::server::ParseAppendBatchMessage(buffer, out)) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "AppendBatchRequest does not parse");
    }
    return grpc::Status::OK;
  }
};
