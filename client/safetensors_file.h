// Reading and writing safetensors files: an 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets: [begin, end)}, and
// "__metadata__": {string: string}}, then the tensor bytes.
//
// A file is accepted only if every check of the format's reference reader
// (huggingface/safetensors, `Metadata::validate`) passes, and a few more:
//  * the header length is at least 2 ("{}"), at most kMaxSafetensorsHeaderBytes
//    and inside the file; the header is one JSON object naming each tensor once;
//  * each tensor has a known dtype, a shape of non-negative integers whose
//    element count and byte count fit in int64 (checked at every step, so a
//    [2^32, 2^32] shape is refused, never wrapped to 0), and data_offsets
//    [begin, end) with begin <= end and end - begin == element count x dtype size;
//  * sorted by offset, the tensors tile the data section exactly: the first
//    starts at 0, each starts where the one before ends (no overlap, no gap),
//    and the last ends at the end of the file. Overlapping tensors would let
//    one write alias another's bytes, and unclaimed bytes mean the file is not
//    what its writer meant; the reference reader refuses both, and so do we.
// A bad file is an INVALID_ARGUMENT saying what is wrong and where; names
// taken from the file are quoted with Quote() (bounded, escaped).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace mlakv {

// The reference reader's bound on the JSON header (bytes).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// Bytes per element of a safetensors dtype name ("BF16" -> 2), or 0 if unknown.
int SafetensorsDTypeSize(std::string_view dtype);

class SafetensorsFile {
 public:
  struct Tensor {
    std::string dtype;           // "BF16", "F16", "F32", "U8", "F8_E4M3", "I32", ...
    std::vector<int64_t> shape;  // [] is a scalar
    std::string_view data;       // points into the file's bytes
    // Product of `shape`. Cannot overflow for a tensor of a SafetensorsFile:
    // Parse refuses shapes whose running product leaves int64.
    int64_t numel() const;
  };

  static absl::StatusOr<SafetensorsFile> Read(const std::string& path);
  // Parses the bytes of a whole file (takes them; the tensors point into
  // them). `name` only labels error messages.
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
  // Copies `data`; its size must equal product(shape) x dtype size (dimensions
  // non-negative, the product within int64).
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
