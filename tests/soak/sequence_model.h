// SequenceModel: what the server must hold for one sequence, kept by the
// client that owns the sequence: per layer the stored bytes of every
// committed position, and the number of pages (docs/server.md "Model").
// A sequence that does not exist is the absence of a model
// (std::optional<SequenceModel>).
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

namespace mlakv::soak {

class SequenceModel {
 public:
  SequenceModel(int num_layers, uint32_t page_size) : page_size_(page_size), layers_(num_layers) {}

  int num_layers() const { return static_cast<int>(layers_.size()); }
  uint32_t page_size() const { return page_size_; }
  uint32_t layer_length(int layer) const;
  uint32_t length() const;      // min over layers: what a decode worker may attend over
  uint32_t max_length() const;  // longest layer
  uint32_t pages() const { return pages_; }
  uint64_t total_tokens() const;
  // Nothing stored and no page held: the server does not keep such a sequence.
  bool empty() const { return pages_ == 0 && max_length() == 0; }

  // Stored entries of `layer` for [start, start + count) (kEntryBytes each).
  absl::string_view Entries(int layer, uint32_t start, uint32_t count) const;
  // `stored` (whole entries) at positions from `start`, which is at most the
  // layer's length (no holes); the layer grows when they reach past its end.
  void Write(int layer, uint32_t start, absl::string_view stored);
  // Pages cover at least `tokens` tokens (appends and reserve_tokens never shrink them).
  void CoverTokens(uint64_t tokens);
  // TruncateSequence: every layer longer than `length` is cut to it, and
  // every page past ceil(length / page_size) is released.
  void Truncate(uint32_t length);
  // Entries of a page for `layer` (GetPage's filled_per_layer).
  uint32_t FilledInPage(int layer, uint32_t page_index) const;

  // Flips one bit of the stored bytes of `token` in `layer` (the self-check
  // of SoakOptions::corrupt_model_after).
  void CorruptForSelfCheck(int layer, uint32_t token);

  bool operator==(const SequenceModel& other) const = default;

 private:
  uint32_t page_size_;
  std::vector<std::string> layers_;  // per layer: length x kEntryBytes
  uint32_t pages_ = 0;
};

}  // namespace mlakv::soak
