#include "client/safetensors_file.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace mlakv {
namespace {

using json = nlohmann::json;

// Header larger than this is refused before allocation (the format's own
// reference implementation uses 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

std::string ShapeString(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

}  // namespace

int SafetensorsDTypeSize(std::string_view dtype) {
  static const std::map<std::string_view, int> kSizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"I64", 8},     {"U64", 8}, {"F64", 8}};
  auto it = kSizes.find(dtype);
  return it == kSizes.end() ? 0 : it->second;
}

int64_t SafetensorsFile::Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
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
  auto bad = [&name](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": not a valid safetensors file: ", what));
  };
  if (bytes.size() < 8) return bad(absl::StrCat("file is ", bytes.size(), " bytes, shorter than the 8-byte header length"));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  if (header_len > kMaxHeaderBytes || header_len > bytes.size() - 8) {
    return bad(absl::StrCat("header length ", header_len, " exceeds the file (", bytes.size() - 8, " bytes follow)"));
  }
  json header = json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<int64_t>(header_len), nullptr,
                            /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) return bad("header is not a JSON object");

  SafetensorsFile file;
  file.name_ = std::move(name);
  const uint64_t data_begin = 8 + header_len;
  const uint64_t data_size = bytes.size() - data_begin;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  std::map<std::string, uint64_t> offsets_of;  // tensor -> begin; views are made once bytes_ is final
  for (auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) return bad("__metadata__ is not an object");
      for (auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) return bad(absl::StrCat("__metadata__[\"", mk, "\"] is not a string"));
        file.metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    const std::string where = absl::StrCat("tensor \"", key, "\"");
    if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") ||
        !value.contains("data_offsets")) {
      return bad(absl::StrCat(where, " needs dtype, shape and data_offsets"));
    }
    const json& dt = value["dtype"];
    const json& shape = value["shape"];
    const json& offsets = value["data_offsets"];
    if (!dt.is_string() || SafetensorsDTypeSize(dt.get<std::string>()) == 0) {
      return bad(absl::StrCat(where, " has unknown dtype ", dt.dump()));
    }
    if (!shape.is_array()) return bad(absl::StrCat(where, " shape is not an array"));
    Tensor t;
    t.dtype = dt.get<std::string>();
    uint64_t numel = 1;
    for (const json& d : shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (1ull << 40)) {
        return bad(absl::StrCat(where, " shape ", shape.dump(), " holds a non-integer, negative or huge dimension"));
      }
      t.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
      numel *= d.get<uint64_t>();
      if (numel > (1ull << 48)) return bad(absl::StrCat(where, " shape ", shape.dump(), " is too large"));
    }
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      return bad(absl::StrCat(where, " data_offsets ", offsets.dump(), " is not [begin, end]"));
    }
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      return bad(absl::StrCat(where, " data_offsets [", begin, ", ", end, ") lie outside the ", data_size,
                              "-byte data section"));
    }
    const uint64_t expected = numel * static_cast<uint64_t>(SafetensorsDTypeSize(t.dtype));
    if (end - begin != expected) {
      return bad(absl::StrCat(where, " is ", end - begin, " bytes but ", t.dtype, ShapeString(t.shape), " needs ",
                              expected));
    }
    ranges.emplace_back(begin, end);
    offsets_of[key] = begin;
    file.tensors_.emplace(key, std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t covered_to = 0;  // end of the furthest-reaching tensor so far
  for (const auto& [begin, end] : ranges) {
    if (begin == end) continue;
    if (begin < covered_to) {
      return bad(absl::StrCat("tensors overlap at data bytes [", begin, ", ", std::min(end, covered_to), ")"));
    }
    covered_to = end;
  }
  file.bytes_ = std::move(bytes);
  const char* base = file.bytes_.data() + data_begin;
  for (auto& [key, t] : file.tensors_) {
    t.data = std::string_view(base + offsets_of[key], static_cast<size_t>(t.numel()) * SafetensorsDTypeSize(t.dtype));
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
    return absl::NotFoundError(absl::StrCat(name_, ": has no tensor \"", tensor, "\""));
  }
  if (std::find(dtypes.begin(), dtypes.end(), t->dtype) == dtypes.end() ||
      (rank >= 0 && static_cast<int>(t->shape.size()) != rank)) {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": tensor \"", tensor, "\" is ", t->dtype,
                                                   ShapeString(t->shape), "; expected ", absl::StrJoin(dtypes, " or "),
                                                   rank >= 0 ? absl::StrCat(" with ", rank, " dimensions") : ""));
  }
  return t;
}

absl::StatusOr<float> SafetensorsFile::GetScalarF32(const std::string& tensor) const {
  absl::StatusOr<const Tensor*> t = Get(tensor, {"F32"});
  if (!t.ok()) return t.status();
  if ((*t)->numel() != 1 || (*t)->shape.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": tensor \"", tensor, "\" is F32",
                                                   ShapeString((*t)->shape), "; expected a scalar [] or [1]"));
  }
  float f;
  std::memcpy(&f, (*t)->data.data(), sizeof(f));
  return f;
}

absl::Status SafetensorsWriter::Add(const std::string& tensor, const std::string& dtype, std::vector<int64_t> shape,
                                    std::string_view data) {
  const int size = SafetensorsDTypeSize(dtype);
  if (size == 0) return absl::InvalidArgumentError(absl::StrCat("unknown safetensors dtype ", dtype));
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (static_cast<int64_t>(data.size()) != numel * size) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", tensor, "\": ", data.size(), " bytes is not ", dtype,
                                                   ShapeString(shape), " (", numel * size, " bytes)"));
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
