// The rows of an append as they travel from where they arrive to the kernel,
// in one representation: the RPC layer fills a LayerRows per layer (the
// message's bytes, or the memory a region reference names, resolved by
// server/regions), the Pool checks and places it, and the backend reads the
// same RowSource the Pool copied into each AppendSegment.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kernels/nvfp4_format.h"

namespace mlakv::server {

// Host bytes that arrived in pieces rather than in one buffer (the slices in
// which gRPC's transport received one message: an Append message's rows are
// read from there, not copied out first; server/rpc/append_wire.h), read in
// order as one run of bytes.
struct BytePieces {
  std::vector<std::string_view> parts;
  std::vector<uint64_t> starts;  // starts[i]: offset of parts[i] in the run

  void Add(std::string_view part) {
    if (part.empty()) return;
    starts.push_back(size());
    parts.push_back(part);
  }
  uint64_t size() const { return parts.empty() ? 0 : starts.back() + parts.back().size(); }
  // Calls fn(const char* data, size_t n) for the bytes [offset, offset +
  // bytes) of the run, in order (the caller keeps within size()).
  template <typename Fn>
  void ForEach(uint64_t offset, uint64_t bytes, Fn&& fn) const {
    size_t i = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), offset) - starts.begin()) - 1;
    for (; bytes > 0 && i < parts.size(); ++i) {
      const uint64_t skip = offset - starts[i];
      const uint64_t n = std::min<uint64_t>(parts[i].size() - skip, bytes);
      fn(parts[i].data() + skip, static_cast<size_t>(n));
      offset += n;
      bytes -= n;
    }
  }
};

// Where one layer's rows of ckv ([rows, 512]) and kpe ([rows, 64]) of one
// dtype lie.
struct RowSource {
  // Host memory (device < 0): packed rows, as the message carried them or as
  // the region registry copied strided host rows together. Device memory
  // (device >= 0, a CUDA region): pointers valid on CUDA device `device`,
  // rows *_stride_bytes apart (even, at least a row).
  const void* ckv = nullptr;
  const void* kpe = nullptr;
  // Host rows in pieces instead (then ckv / kpe are null): the rows are the
  // bytes from ckv_offset / kpe_offset on of *ckv_pieces / *kpe_pieces,
  // packed. Read them with ForEachHostRun.
  const BytePieces* ckv_pieces = nullptr;
  const BytePieces* kpe_pieces = nullptr;
  uint64_t ckv_offset = 0;
  uint64_t kpe_offset = 0;
  int device = -1;
  int64_t ckv_stride_bytes = 0;  // device rows only
  int64_t kpe_stride_bytes = 0;
  // Device rows: cudaEvent_t the pool waits for before reading (the
  // producer's IPC event; CudaBackend::Launch waits on the host), or null.
  const void* wait_events[2] = {nullptr, nullptr};

  bool on_device() const { return device >= 0; }

  // The same rows from row `n` on; `element_bytes` is the rows' dtype size
  // (host rows are packed: a ckv row is 512 elements, a kpe row 64).
  RowSource From(uint64_t n, uint64_t element_bytes) const {
    RowSource out = *this;
    const uint64_t ckv_step = on_device() ? static_cast<uint64_t>(ckv_stride_bytes) : format::kCkvDim * element_bytes;
    const uint64_t kpe_step = on_device() ? static_cast<uint64_t>(kpe_stride_bytes) : format::kKpeDim * element_bytes;
    if (ckv_pieces != nullptr) {
      out.ckv_offset += n * ckv_step;
    } else {
      out.ckv = static_cast<const char*>(ckv) + n * ckv_step;
    }
    if (kpe_pieces != nullptr) {
      out.kpe_offset += n * kpe_step;
    } else {
      out.kpe = static_cast<const char*>(kpe) + n * kpe_step;
    }
    return out;
  }
};

// Calls fn(const char* data, size_t n) for the first `bytes` bytes of host
// rows `rows` of ckv (or of kpe), in order: once for rows in one buffer, once
// per piece for rows in pieces.
template <typename Fn>
void ForEachHostRun(const RowSource& rows, bool ckv, uint64_t bytes, Fn&& fn) {
  const BytePieces* pieces = ckv ? rows.ckv_pieces : rows.kpe_pieces;
  if (pieces != nullptr) {
    pieces->ForEach(ckv ? rows.ckv_offset : rows.kpe_offset, bytes, fn);
  } else if (bytes > 0) {
    fn(static_cast<const char*>(ckv ? rows.ckv : rows.kpe), static_cast<size_t>(bytes));
  }
}

// The rows of one layer in one append: where they are, how many bytes they
// span packed (what the Pool checks against row_count x dtype), and the
// scales they were calibrated for (0 and 0: not named, the layer's apply).
struct LayerRows {
  int32_t layer = 0;  // checked by the Pool against [0, num_layers)
  RowSource source;
  uint64_t ckv_bytes = 0;
  uint64_t kpe_bytes = 0;
  float ckv_scale = 0.0f;
  float kpe_scale = 0.0f;

  // Packed host rows given as their bytes.
  static LayerRows FromBytes(int32_t layer, std::string_view ckv, std::string_view kpe, float ckv_scale = 0.0f,
                             float kpe_scale = 0.0f) {
    return {.layer = layer,
            .source = {.ckv = ckv.data(), .kpe = kpe.data()},
            .ckv_bytes = ckv.size(),
            .kpe_bytes = kpe.size(),
            .ckv_scale = ckv_scale,
            .kpe_scale = kpe_scale};
  }
  // Packed host rows given in pieces (the pieces outlive the append).
  static LayerRows FromPieces(int32_t layer, const BytePieces& ckv, const BytePieces& kpe, float ckv_scale = 0.0f,
                              float kpe_scale = 0.0f) {
    return {.layer = layer,
            .source = {.ckv_pieces = &ckv, .kpe_pieces = &kpe},
            .ckv_bytes = ckv.size(),
            .kpe_bytes = kpe.size(),
            .ckv_scale = ckv_scale,
            .kpe_scale = kpe_scale};
  }
};

}  // namespace mlakv::server
