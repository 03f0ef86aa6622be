// Propagation macros for absl::Status / absl::StatusOr, used by every room of
// the project (kernels' host code, core, backends, regions, rpc, client).
//
//   MLAKV_RETURN_IF_ERROR(expr);            // returns expr's status if not OK
//   MLAKV_ASSIGN_OR_RETURN(auto x, expr);   // x = *expr, or returns expr.status()
//
// Both evaluate `expr` once. The status is returned unchanged; callers that
// want context wrap it themselves (WithContext below) so that every message
// still reads "what, where: why".
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#define MLAKV_STATUS_MACROS_CONCAT_INNER(a, b) a##b
#define MLAKV_STATUS_MACROS_CONCAT(a, b) MLAKV_STATUS_MACROS_CONCAT_INNER(a, b)

#define MLAKV_RETURN_IF_ERROR(expr)                                  \
  do {                                                               \
    if (::absl::Status mlakv_status_ = (expr); !mlakv_status_.ok()) { \
      return mlakv_status_;                                          \
    }                                                                \
  } while (false)

#define MLAKV_ASSIGN_OR_RETURN(lhs, expr) \
  MLAKV_ASSIGN_OR_RETURN_IMPL(MLAKV_STATUS_MACROS_CONCAT(mlakv_statusor_, __LINE__), lhs, expr)

#define MLAKV_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                                \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(*statusor)

namespace mlakv {

// `status` with "`context`: " in front of its message (same code); OK stays OK.
inline absl::Status WithContext(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace mlakv
