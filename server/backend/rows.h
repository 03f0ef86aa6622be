// The rows of an append as they travel from where they arrive to the kernel,
// in one representation: the RPC layer fills a LayerRows per layer (the
// message's bytes, or the memory a region reference names, resolved by
// server/regions), the Pool checks and places it, and the backend reads the
// same RowSource the Pool copied into each AppendSegment.
#pragma once

#include <cstdint>
#include <string_view>

#include "kernels/nvfp4_format.h"

namespace mlakv::server {

// Where one layer's rows of ckv ([rows, 512]) and kpe ([rows, 64]) of one
// dtype lie.
struct RowSource {
  // Host memory (device < 0): packed rows, as the message carried them or as
  // the region registry copied strided host rows together. Device memory
  // (device >= 0, a CUDA region): pointers valid on CUDA device `device`,
  // rows *_stride_bytes apart (even, at least a row).
  const void* ckv = nullptr;
  const void* kpe = nullptr;
  int device = -1;
  int64_t ckv_stride_bytes = 0;  // device rows only
  int64_t kpe_stride_bytes = 0;
  // Device rows: cudaEvent_t the pool's stream waits on before reading (the
  // producer's IPC event), or null.
  const void* wait_events[2] = {nullptr, nullptr};

  bool on_device() const { return device >= 0; }

  // The same rows from row `n` on; `element_bytes` is the rows' dtype size
  // (host rows are packed: a ckv row is 512 elements, a kpe row 64).
  RowSource From(uint64_t n, uint64_t element_bytes) const {
    RowSource out = *this;
    const uint64_t ckv_step = on_device() ? static_cast<uint64_t>(ckv_stride_bytes) : format::kCkvDim * element_bytes;
    const uint64_t kpe_step = on_device() ? static_cast<uint64_t>(kpe_stride_bytes) : format::kKpeDim * element_bytes;
    out.ckv = static_cast<const char*>(ckv) + n * ckv_step;
    out.kpe = static_cast<const char*>(kpe) + n * kpe_step;
    return out;
  }
};

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
};

}  // namespace mlakv::server
