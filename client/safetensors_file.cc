#include "client/safetensors_file.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace mlakv {
namespace {

using json = nlohmann::json;

// dtype names and element sizes, in the order the format's spec lists them.
constexpr std::pair<std::string_view, int> kDTypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
    {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}};

// At most this many dimensions are printed in a message ("[1, 2, ... (40 dimensions)]").
constexpr size_t kMaxShownDims = 8;

std::string ShapeString(const std::vector<int64_t>& shape) {
  if (shape.size() <= kMaxShownDims) return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
  return absl::StrCat("[", absl::StrJoin(shape.begin(), shape.begin() + kMaxShownDims, ", "), ", ... (",
                      shape.size(), " dimensions)]");
}

// A JSON value from the header, for a message: scalars as their (bounded,
// quoted) text, arrays and objects by kind only. Never a recursive dump: the
// header is the file's, and may nest a million levels deep.
std::string Describe(const json& v) {
  switch (v.type()) {
    case json::value_t::array:
      return absl::StrCat("an array of ", v.size(), " elements");
    case json::value_t::object:
      return absl::StrCat("an object of ", v.size(), " members");
    case json::value_t::string:
      return absl::StrCat("the string ", Quote(v.get_ref<const std::string&>(), 64));
    default:
      return Quote(v.dump(-1, ' ', false, json::error_handler_t::replace), 64);
  }
}

// A non-negative JSON integer that fits in int64, or -1.
int64_t NonNegativeInt64(const json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    return u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? static_cast<int64_t>(u) : -1;
  }
  if (v.is_number_integer() && v.get<int64_t>() == 0) return 0;  // "-0"
  return -1;
}

// Element count of `shape`, checked at every step (a later 0 does not excuse
// an overflow earlier on, as in the reference reader); nullopt on a negative
// dimension or an overflow.
std::optional<int64_t> CheckedNumel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return n;
}

}  // namespace

int SafetensorsDTypeSize(std::string_view dtype) {
  for (const auto& [name, size] : kDTypes) {
    if (name == dtype) return size;
  }
  return 0;
}

int64_t SafetensorsFile::Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // bounded: see the declaration
  return n;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open (", std::strerror(errno), ")"));
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return Parse(std::move(buf).str(), path);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Parse(std::string bytes, std::string name) {
  auto bad = [&name](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": not a valid safetensors file: ", what));
  };
  if (bytes.size() < 8) {
    return bad(absl::StrCat("file is ", bytes.size(), " bytes, shorter than the 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  const uint64_t after_length = bytes.size() - 8;
  if (header_len < 2) {
    return bad(absl::StrCat("header length ", header_len, " is shorter than the smallest header, {} (2 bytes)"));
  }
  if (header_len > kMaxSafetensorsHeaderBytes) {
    return bad(absl::StrCat("header length ", header_len, " exceeds the format's limit of ",
                            kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (header_len > after_length) {
    return bad(absl::StrCat("header length ", header_len, " exceeds the file (", after_length,
                            " bytes follow the length)"));
  }

  // nlohmann keeps the last of two equal keys; a tensor named twice is
  // ambiguous, so the parse notes the first repeated top-level key.
  std::set<std::string> keys;
  std::string repeated;
  bool has_repeated = false;
  json::parser_callback_t note_keys = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key && !has_repeated &&
        !keys.insert(parsed.get_ref<const std::string&>()).second) {
      has_repeated = true;
      repeated = parsed.get_ref<const std::string&>();
    }
    return true;
  };
  const char* header_begin = bytes.data() + 8;
  json header = json::parse(header_begin, header_begin + header_len, note_keys, /*allow_exceptions=*/false);
  if (header.is_discarded()) return bad(absl::StrCat("the ", header_len, "-byte header is not valid JSON"));
  if (!header.is_object()) return bad(absl::StrCat("the header is ", Describe(header), ", not a JSON object"));
  if (has_repeated) return bad(absl::StrCat("the header names ", Quote(repeated), " twice"));

  SafetensorsFile file;
  file.name_ = std::move(name);
  const uint64_t data_begin = 8 + header_len;
  const uint64_t data_size = bytes.size() - data_begin;
  struct Span {
    uint64_t begin, end;
    const std::string* tensor;
  };
  std::vector<Span> spans;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) return bad(absl::StrCat("__metadata__ is ", Describe(value), ", not an object"));
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) {
          return bad(absl::StrCat("__metadata__[", Quote(mk), "] is ", Describe(mv), ", not a string"));
        }
        file.metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    const std::string where = absl::StrCat("tensor ", Quote(key));
    if (!value.is_object()) {
      return bad(absl::StrCat(where, " is ", Describe(value), ", not an object {dtype, shape, data_offsets}"));
    }
    const auto dt = value.find("dtype"), shape = value.find("shape"), offsets = value.find("data_offsets");
    if (dt == value.end() || shape == value.end() || offsets == value.end()) {
      return bad(absl::StrCat(where, " needs dtype, shape and data_offsets"));
    }
    Tensor t;
    if (!dt->is_string()) return bad(absl::StrCat(where, " has dtype ", Describe(*dt), ", not a dtype name"));
    t.dtype = dt->get<std::string>();
    const int dtype_size = SafetensorsDTypeSize(t.dtype);
    if (dtype_size == 0) {
      std::vector<absl::string_view> known;
      for (const auto& [n, size] : kDTypes) known.emplace_back(n.data(), n.size());
      return bad(absl::StrCat(where, " has unknown dtype ", Quote(t.dtype, 32), " (known: ", absl::StrJoin(known, ", "),
                              ")"));
    }
    if (!shape->is_array()) return bad(absl::StrCat(where, " has shape ", Describe(*shape), ", not an array"));
    t.shape.reserve(shape->size());
    for (size_t i = 0; i < shape->size(); ++i) {
      const int64_t d = NonNegativeInt64((*shape)[i]);
      if (d < 0) {
        return bad(absl::StrCat(where, " has dimension ", i, " = ", Describe((*shape)[i]),
                                "; dimensions are integers in [0, 2^63)"));
      }
      t.shape.push_back(d);
    }
    const std::optional<int64_t> numel = CheckedNumel(t.shape);
    int64_t nbytes = 0;
    if (!numel) {
      return bad(absl::StrCat(where, " has shape ", ShapeString(t.shape), ", more than 2^63 - 1 elements"));
    }
    if (__builtin_mul_overflow(*numel, static_cast<int64_t>(dtype_size), &nbytes)) {
      return bad(absl::StrCat(where, " is ", t.dtype, ShapeString(t.shape), ", more than 2^63 - 1 bytes"));
    }
    if (!offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
        !(*offsets)[1].is_number_unsigned()) {
      return bad(absl::StrCat(where, " has data_offsets ", Describe(*offsets),
                              "; expected [begin, end], two non-negative integers"));
    }
    const uint64_t begin = (*offsets)[0].get<uint64_t>(), end = (*offsets)[1].get<uint64_t>();
    if (begin > end) return bad(absl::StrCat(where, " has data_offsets [", begin, ", ", end, "]: begin > end"));
    if (end > data_size) {
      return bad(absl::StrCat(where, " has data_offsets [", begin, ", ", end, ") past the end of the ", data_size,
                              "-byte data section"));
    }
    if (end - begin != static_cast<uint64_t>(nbytes)) {
      return bad(absl::StrCat(where, " holds ", end - begin, " bytes (data_offsets [", begin, ", ", end, ")) but ",
                              t.dtype, ShapeString(t.shape), " is ", nbytes, " bytes"));
    }
    auto [it, inserted] = file.tensors_.emplace(key, std::move(t));
    spans.push_back({begin, end, &it->first});
  }

  // The tensors must tile [0, data_size) (see the header comment).
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  uint64_t covered = 0;  // every byte before this belongs to exactly one tensor
  const std::string* last = nullptr;
  for (const Span& s : spans) {
    if (s.begin < covered) {
      return bad(absl::StrCat("tensor ", Quote(*s.tensor), " at data bytes [", s.begin, ", ", s.end,
                              ") overlaps tensor ", Quote(*last), ", which ends at ", covered));
    }
    if (s.begin > covered) {
      return bad(absl::StrCat("data bytes [", covered, ", ", s.begin, ") before tensor ", Quote(*s.tensor),
                              " belong to no tensor"));
    }
    covered = s.end;
    last = s.tensor;
  }
  if (covered != data_size) {
    return bad(absl::StrCat("data bytes [", covered, ", ", data_size, ") at the end of the file belong to no tensor"));
  }

  file.bytes_ = std::move(bytes);
  const char* base = file.bytes_.data() + data_begin;
  for (const Span& s : spans) {
    file.tensors_.at(*s.tensor).data = std::string_view(base + s.begin, static_cast<size_t>(s.end - s.begin));
  }
  return file;
}

const SafetensorsFile::Tensor* SafetensorsFile::Find(const std::string& tensor) const {
  auto it = tensors_.find(tensor);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::StatusOr<const SafetensorsFile::Tensor*> SafetensorsFile::Get(const std::string& tensor,
                                                                    const std::vector<std::string>& dtypes,
                                                                    int rank) const {
  const Tensor* t = Find(tensor);
  if (t == nullptr) {
    return absl::NotFoundError(absl::StrCat(name_, ": has no tensor ", Quote(tensor)));
  }
  if (std::find(dtypes.begin(), dtypes.end(), t->dtype) == dtypes.end() ||
      (rank >= 0 && static_cast<int>(t->shape.size()) != rank)) {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": tensor ", Quote(tensor), " is ", t->dtype,
                                                   ShapeString(t->shape), "; expected ", absl::StrJoin(dtypes, " or "),
                                                   rank >= 0 ? absl::StrCat(" with ", rank, " dimensions") : ""));
  }
  return t;
}

absl::StatusOr<float> SafetensorsFile::GetScalarF32(const std::string& tensor) const {
  MLAKV_ASSIGN_OR_RETURN(const Tensor* t, Get(tensor, {"F32"}));
  if (t->numel() != 1 || t->shape.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": tensor ", Quote(tensor), " is F32",
                                                   ShapeString(t->shape), "; expected a scalar [] or [1]"));
  }
  float f;
  std::memcpy(&f, t->data.data(), sizeof(f));
  return f;
}

absl::Status SafetensorsWriter::Add(const std::string& tensor, const std::string& dtype, std::vector<int64_t> shape,
                                    std::string_view data) {
  const int size = SafetensorsDTypeSize(dtype);
  if (size == 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", Quote(tensor), ": unknown safetensors dtype ",
                                                   Quote(dtype, 32)));
  }
  const std::optional<int64_t> numel = CheckedNumel(shape);
  int64_t nbytes = 0;
  if (!numel || __builtin_mul_overflow(*numel, static_cast<int64_t>(size), &nbytes)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", Quote(tensor), ": shape ", ShapeString(shape),
                                                   " has a negative dimension or more than 2^63 - 1 bytes of ", dtype));
  }
  if (data.size() != static_cast<uint64_t>(nbytes)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", Quote(tensor), ": ", data.size(), " bytes is not ", dtype,
                                                   ShapeString(shape), " (", nbytes, " bytes)"));
  }
  entries_[tensor] = Entry{dtype, std::move(shape), std::string(data)};
  return absl::OkStatus();
}

std::string SafetensorsWriter::Serialize() const {
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& [name, e] : entries_) {
    header[name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.data.size()}}};
    offset += e.data.size();
  }
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data section 8-byte aligned
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((static_cast<uint64_t>(text.size()) >> (8 * i)) & 0xFF);
  out += text;
  for (const auto& [name, e] : entries_) out += e.data;
  return out;
}

absl::Status SafetensorsWriter::Write(const std::string& path) const {
  const std::string bytes = Serialize();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot write (", std::strerror(errno), ")"));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat(path, ": rename failed (", std::strerror(errno), ")"));
  }
  return absl::OkStatus();
}

}  // namespace mlakv
