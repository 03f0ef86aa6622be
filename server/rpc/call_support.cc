#include "server/rpc/call_support.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "server/rpc/grpc_status.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {

absl::Status DrainingError() {
  return absl::UnavailableError("server is shutting down and accepts no new calls; retry on another replica");
}

absl::Status CheckFieldLength(absl::string_view field, absl::string_view value, size_t max_bytes) {
  if (value.size() <= max_bytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, " ", Quote(value), " is ", value.size(), " bytes; at most ",
                                                 max_bytes, " are accepted"));
}

absl::Status CheckCallAlive(const cq::CallContext* ctx, absl::string_view what) {
  // The deadline first: gRPC cancels a call whose deadline passed, so a
  // cancelled call past its deadline is reported (logged, counted) as what
  // it is.
  if (ctx->deadline() <= std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError(absl::StrCat("the call's deadline passed before it committed; ", what));
  }
  if (ctx->cancelled()) {
    return absl::CancelledError(
        absl::StrCat("the call was cancelled (by the client, or its connection broke) before it committed; ", what));
  }
  return absl::OkStatus();
}

void LogCall(absl::string_view method, absl::string_view detail, const absl::Status& status) {
  if (status.ok()) {
    spdlog::debug("{} {}: OK", std::string(method), std::string(detail));
  } else {
    spdlog::warn("{} {}: {} {}", std::string(method), std::string(detail), absl::StatusCodeToString(status.code()),
                 std::string(status.message()));
  }
}

grpc::Status FinishCall(absl::string_view method, absl::FunctionRef<std::string()> detail,
                        const absl::Status& status) {
  const spdlog::level::level_enum level = status.ok() ? spdlog::level::debug : spdlog::level::warn;
  if (spdlog::should_log(level)) LogCall(method, detail(), status);
  return ToGrpcStatus(status);
}

}  // namespace mlakv::server
