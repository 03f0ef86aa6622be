// Reading and writing safetensors files: an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets: [begin, end)}, and
// "__metadata__": {string: string}}, then the tensor bytes. The header is
// parsed with nlohmann-json and validated before any tensor is handed out:
// offsets inside the data section, shape x dtype size == byte length, no two
// tensors overlapping. A bad file is an INVALID_ARGUMENT naming the problem.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace mlakv {

// Bytes per element of a safetensors dtype name ("BF16" -> 2), or 0 if unknown.
int SafetensorsDTypeSize(std::string_view dtype);

class SafetensorsFile {
 public:
  struct Tensor {
    std::string dtype;           // "BF16", "F16", "F32", "U8", "F8_E4M3", "I32", ...
    std::vector<int64_t> shape;  // [] is a scalar
    std::string_view data;       // points into the file's bytes
    int64_t numel() const;
  };

  static absl::StatusOr<SafetensorsFile> Read(const std::string& path);
  // `name` only labels error messages.
  static absl::StatusOr<SafetensorsFile> Parse(std::string bytes, std::string name);

  SafetensorsFile(SafetensorsFile&&) noexcept = default;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept = default;

  const Tensor* Find(const std::string& tensor) const;
  // The tensor, checked to have one of `dtypes` and `rank` dimensions (-1: any).
  absl::StatusOr<const Tensor*> Get(const std::string& tensor, const std::vector<std::string>& dtypes,
                                    int rank = -1) const;
  // A float32 scalar stored as F32 [] or [1].
  absl::StatusOr<float> GetScalarF32(const std::string& tensor) const;

  const std::map<std::string, Tensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& name() const { return name_; }

 private:
  SafetensorsFile() = default;
  std::string name_;
  std::string bytes_;
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

class SafetensorsWriter {
 public:
  // Copies `data`; its size must equal product(shape) x dtype size.
  absl::Status Add(const std::string& tensor, const std::string& dtype, std::vector<int64_t> shape,
                   std::string_view data);
  void SetMetadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  std::string Serialize() const;
  absl::Status Write(const std::string& path) const;

 private:
  struct Entry {
    std::string dtype;
    std::vector<int64_t> shape;
    std::string data;
  };
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace mlakv
