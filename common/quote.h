// Quoting of client-chosen strings (sequence ids, pool and region names,
// shm names, page tokens) in statuses and logs.
//
// A client may send any bytes up to the message limit; echoing them back
// verbatim would let a 63 MB id become a 63 MB log line, a newline forge a
// log line, and a 64 KB id push a status over the client's metadata limit.
// Quote() keeps at most `max_bytes` of the input, escapes quotes, backslashes
// and every byte outside printable ASCII (C-style, "\n", "\x01", "\303"),
// and says how long the original was when it cut:
//   Quote("req-1")             -> 'req-1'
//   Quote("a\nb")              -> 'a\nb'
//   Quote(std::string(5000,'x')) -> 'xxx...x'... (5000 bytes)
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace mlakv {

// Bytes of the input that Quote keeps by default.
inline constexpr size_t kQuotePrefixBytes = 128;

std::string Quote(absl::string_view s, size_t max_bytes = kQuotePrefixBytes);

}  // namespace mlakv
