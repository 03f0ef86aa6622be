#include "client/append_stream.h"

namespace mlakv {

grpc::Status WriteAppendStream(grpc::ClientWriterInterface<v1::AppendRequest>& writer, size_t messages,
                               absl::FunctionRef<v1::AppendRequest(size_t)> message_at) {
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
