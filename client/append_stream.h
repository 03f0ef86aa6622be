// The write side of one client Append stream: the messages in order, the last
// carrying the half-close, then Finish.
//
// gRPC sends a half-close at most once per call: a Write with
// WriteOptions::set_last_message() starts the half-close together with the
// message, and it counts as sent even when that Write returns false (the
// server may have answered, and closed the stream, while the write was in
// flight). Calling WritesDone after it is an API misuse that aborts the
// process (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS), so WritesDone is called only
// when the last message was never written.
#pragma once

#include <cstddef>
#include <type_traits>

#include "absl/functional/function_ref.h"
#include "grpcpp/support/status.h"
#include "grpcpp/support/sync_stream.h"

namespace mlakv {

// Writes message_at(0) .. message_at(messages - 1) (messages >= 1) and returns
// the stream's status. A failed Write ends the writing early: the stream is
// broken and Finish says why. Message: v1::AppendRequest, or a grpc::ByteBuffer
// already serialized (client/append_wire.h).
template <typename Message>
grpc::Status WriteAppendStream(grpc::ClientWriterInterface<Message>& writer, size_t messages,
                               absl::FunctionRef<std::type_identity_t<Message>(size_t)> message_at) {
  bool half_close_started = false;
  for (size_t i = 0; i < messages; ++i) {
    const bool last = i + 1 == messages;
    const bool written =
        writer.Write(message_at(i), last ? grpc::WriteOptions().set_last_message() : grpc::WriteOptions());
    half_close_started = last;  // started with the write, whatever it returned
    if (!written) break;
  }
  if (!half_close_started) writer.WritesDone();
  return writer.Finish();
}

}  // namespace mlakv
