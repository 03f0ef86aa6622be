#include "common/quote.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace mlakv {

std::string Quote(absl::string_view s, size_t max_bytes) {
  const bool cut = s.size() > max_bytes;
  // CHexEscape escapes ', ", \ and every non-printable byte (as \n, \t, \xNN).
  std::string out = absl::StrCat("'", absl::CHexEscape(cut ? s.substr(0, max_bytes) : s), "'");
  if (cut) absl::StrAppend(&out, "... (", s.size(), " bytes)");
  return out;
}

}  // namespace mlakv
