// What every handler of the service does the same way: the log line of a
// call, the unary prelude (drain check, request string limits, pool lookup),
// and the checks that keep a failed call from being applied (cancelled, past
// its deadline).
#pragma once

#include <grpcpp/grpcpp.h>

#include "server/cq/calls.h"

#include <string>
#include "absl/functional/function_ref.h"
#include "absl/strings/string_view.h"

#include "absl/status/status.h"

namespace mlakv::server {

// Longest pool name, page token or other client-chosen name a call accepts.
inline constexpr size_t kMaxNameBytes = 1024;
// Entries of a paginated listing (ListSequences, ListLeases): when the
// request leaves page_size 0, and at most.
inline constexpr uint32_t kDefaultListPageSize = 100;
inline constexpr uint32_t kMaxListPageSize = 1000;

// UNAVAILABLE: the server is draining.
absl::Status DrainingError();

// INVALID_ARGUMENT when `value` (the request field `field`) is longer than
// `max_bytes`; the message quotes a bounded prefix.
absl::Status CheckFieldLength(absl::string_view field, absl::string_view value, size_t max_bytes = kMaxNameBytes);

// CANCELLED when the client cancelled the call (or its transport broke),
// DEADLINE_EXCEEDED when its deadline has passed; `what` says what is then
// not done ("nothing was written"). Called right before a mutation is
// applied, so that a call that failed is never applied.
absl::Status CheckCallAlive(const cq::CallContext* ctx, absl::string_view what);

// One line per call at debug, one per failed call at warn (detail quotes
// client-chosen strings with Quote()).
void LogCall(absl::string_view method, absl::string_view detail, const absl::Status& status);

// Logs a call's end (LogCall) and returns its status as gRPC's.
// `detail` is only built when the line is logged: a successful call at info
// level builds no string.
grpc::Status FinishCall(absl::string_view method, absl::FunctionRef<std::string()> detail,
                        const absl::Status& status);

}  // namespace mlakv::server
