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
#include <grpcpp/support/slice.h>

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

// The rows-out reading alone over `slices`: false when it does not take the
// message apart (the caller then parses the plain way) or protobuf refuses
// what is left.
bool ParseLeavingRows(const std::vector<grpc::Slice>& slices, v1::AppendRequest* message,
                      std::vector<LayerPieces>* rows);

}  // namespace mlakv::server
