// Helpers shared by the Pool's source files (pool*.cc); not part of the
// room's interface.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/quote.h"

namespace mlakv::server::pool_internal {

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// "sequence 'id'" for messages, with the id quoted safely (common/quote.h).
inline std::string Who(const std::string& id) { return absl::StrCat("sequence ", Quote(id)); }

}  // namespace mlakv::server::pool_internal
