#include "tests/soak/sequence_model.h"

#include <algorithm>
#include <limits>

#include "tests/soak/soak_options.h"

namespace mlakv::soak {

uint32_t SequenceModel::layer_length(int layer) const {
  return static_cast<uint32_t>(layers_[layer].size() / kEntryBytes);
}

uint32_t SequenceModel::length() const {
  uint32_t n = std::numeric_limits<uint32_t>::max();
  for (int l = 0; l < num_layers(); ++l) n = std::min(n, layer_length(l));
  return layers_.empty() ? 0 : n;
}

uint32_t SequenceModel::max_length() const {
  uint32_t n = 0;
  for (int l = 0; l < num_layers(); ++l) n = std::max(n, layer_length(l));
  return n;
}

uint64_t SequenceModel::total_tokens() const {
  uint64_t n = 0;
  for (int l = 0; l < num_layers(); ++l) n += layer_length(l);
  return n;
}

absl::string_view SequenceModel::Entries(int layer, uint32_t start, uint32_t count) const {
  return absl::string_view(layers_[layer]).substr(size_t{start} * kEntryBytes, size_t{count} * kEntryBytes);
}

void SequenceModel::Write(int layer, uint32_t start, absl::string_view stored) {
  std::string& bytes = layers_[layer];
  const size_t at = size_t{start} * kEntryBytes;
  if (at + stored.size() > bytes.size()) bytes.resize(at + stored.size());
  bytes.replace(at, stored.size(), stored.data(), stored.size());
  CoverTokens(start + stored.size() / kEntryBytes);
}

void SequenceModel::CoverTokens(uint64_t tokens) {
  const uint64_t pages = (tokens + page_size_ - 1) / page_size_;
  pages_ = std::max<uint32_t>(pages_, static_cast<uint32_t>(pages));
}

void SequenceModel::Truncate(uint32_t length) {
  for (std::string& bytes : layers_) {
    if (bytes.size() > size_t{length} * kEntryBytes) bytes.resize(size_t{length} * kEntryBytes);
  }
  pages_ = std::min<uint32_t>(pages_, (length + page_size_ - 1) / page_size_);
}

void SequenceModel::CorruptForSelfCheck(int layer, uint32_t token) { layers_[layer][size_t{token} * kEntryBytes] ^= 1; }

uint32_t SequenceModel::FilledInPage(int layer, uint32_t page_index) const {
  const uint64_t first = uint64_t{page_index} * page_size_;
  const uint32_t len = layer_length(layer);
  return len <= first ? 0 : static_cast<uint32_t>(std::min<uint64_t>(page_size_, len - first));
}

}  // namespace mlakv::soak
