// RawAppendCall: an Append stream whose messages are raw bytes, so a fault
// can send what the typed stub cannot: a truncated AppendRequest, invalid
// UTF-8 in a string field. It is a generic call of /mlakv.v1.KvCache/Append
// (on the wire an Append like any other), driven one operation at a time on
// its own completion queue.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace mlakv::soak {

class RawAppendCall {
 public:
  struct Result {
    grpc::Status status;
    size_t messages_written = 0;  // writes that succeeded
    bool got_response = false;    // the server sent an AppendResponse
  };

  // Writes `messages` in order, half-closes, reads the response and finishes.
  // Writing stops at the first failed write (the server ended the stream).
  static Result Run(const std::shared_ptr<grpc::Channel>& channel, const std::vector<std::string>& messages,
                    absl::Duration timeout);
};

}  // namespace mlakv::soak
