// CacheBackend: where one pool's caches live and the code that touches them.
//
// Two implementations behind this interface, the same contract byte for byte:
//  * CpuBackend:  host memory, QuantizeAppendHost (kernels/).
//  * CudaBackend: device memory (cudaMalloc), one stream per pool, rows staged
//                 through pinned host buffers, the QuantizeAppend launcher.
// Per layer the caches are exactly those of docs/format.md: ckv [num_pages, page_size, 256],
// ckv_sf [num_pages, page_size, 32], kpe [num_pages, page_size, 64].
//
// A backend never decides placement: the Pool hands it host-resident page
// tables and positions it has already checked; the backend re-checks every row
// with ValidateRowPlacement before anything is written (never out of bounds).
// Calls are serialized by the caller (the pool's worker); every call returns
// only once its work is complete (the CUDA backend synchronizes its stream).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/quantize_append.h"
#include "kernels/tensor_view.h"
#include "server/backend/device.h"
#include "server/backend/rows.h"

namespace mlakv::server {

// A run of rows of one request at consecutive positions. A request's page
// table need not be a sequence's whole table: the pool passes only the
// entries an append's rows land in (a decode step's one page per sequence),
// so `start` counts from the first of them.
struct AppendSegment {
  RowSource rows;       // where they are (server/backend/rows.h)
  int32_t count = 0;    // rows in the run
  int32_t request = 0;  // index into the page table's requests (kv_indptr)
  int32_t start = 0;    // position of the first row inside its request's entries
};

// Rows for one layer, against one host page table.
struct LayerAppend {
  int32_t layer = 0;
  DType dtype = DType::kBFloat16;  // kFloat16 or kBFloat16
  float ckv_scale = 1.0f;          // the layer's decode scales (positive normal)
  float kpe_scale = 1.0f;
  std::span<const AppendSegment> segments;
  // Set when the rows of all segments lie one after another here, in
  // segment order (AppendBatch's compact form: one range per layer for all
  // the call's sequences). The segments' own `rows` are then unused, so the
  // layers of one call can share one `segments` span — one placement, which
  // a backend recognises by the span alone. Unset: each segment's `rows`.
  std::optional<RowSource> rows;
  std::span<const int32_t> kv_indptr;   // [batch + 1], host
  std::span<const int32_t> kv_indices;  // [kv_indptr[batch]], host
};

// Where `seg`, a non-empty segment of `la`, reads its rows; `first_row` is
// the sum of the counts of the non-empty segments before it.
inline RowSource SegmentRows(const LayerAppend& la, const AppendSegment& seg, int64_t first_row) {
  return la.rows ? la.rows->From(static_cast<uint64_t>(first_row), DTypeSize(la.dtype)) : seg.rows;
}

// The layer's rows when they are device rows that follow each other in
// memory, in segment order (a layer's one run from a CUDA region, or a
// decode step's rows of all sequences in one region range): a device backend
// then reads them in place, with nothing to stage but the placement. Else
// unset.
std::optional<RowSource> ContiguousDeviceRows(const LayerAppend& la);

// Where the rows of one layer are read from / written to: cache entries
// (page * page_size + slot), and host buffers of n rows each.
struct EntryRows {
  uint8_t* ckv_packed = nullptr;  // [n, 256]
  uint8_t* ckv_sf = nullptr;      // [n, 32]
  uint8_t* kpe = nullptr;         // [n, 64]
};

class CacheBackend {
 public:
  struct Geometry {
    int32_t num_layers = 0;  // layers, >= 1
    int32_t num_pages = 0;   // pages per layer, >= 1
    int32_t page_size = 0;   // tokens per page, >= 1
  };

  virtual ~CacheBackend() = default;

  // Where the caches are.
  virtual Device device() const = 0;
  // Bytes held by the caches of all layers.
  virtual uint64_t cache_bytes() const = 0;

  // Quantizes and appends rows into one or more layers. Every row's placement
  // is validated for every layer before the first byte is written.
  virtual absl::Status Append(std::span<const LayerAppend> layers) = 0;
  // Copies the stored bytes of `entries` of `layer` into `out`.
  virtual absl::Status ReadEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& out) = 0;
  // Writes stored bytes back (restoring rows an aborted append rewrote).
  virtual absl::Status WriteEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& in) = 0;
  // Whether every one of `events` (RowSource::wait_events: the producers'
  // events device rows are read behind) has completed. Never blocks, and may
  // be called from any thread, beside the worker's calls (SourceWaiter).
  // A backend without device rows has no events: true.
  virtual absl::StatusOr<bool> EventsComplete(std::span<const void* const> events) {
    static_cast<void>(events);
    return true;
  }

  // ExportPool: a cudaIpcMemHandle_t (64 bytes) of each layer's three caches,
  // each its own allocation starting at the cache's first byte. Only device
  // caches can be exported: FAILED_PRECONDITION by default.
  struct LayerHandles {
    std::string ckv, ckv_sf, kpe;
  };
  virtual absl::StatusOr<std::vector<LayerHandles>> ExportHandles() const {
    return absl::FailedPreconditionError(absl::StrCat(
        "the caches of a ", device().ToString(), " pool are not CUDA memory and cannot be exported; read them with ReadSequence"));
  }
};

// The params both backends start one layer's append from: the layer's caches
// (`ckv`, `sf`, `kpe`), the pool's geometry, the page table (host pointers)
// and the scales. Rows, row count and placement are the backend's to fill.
QuantizeAppendParams LayerParams(const LayerAppend& la, const CacheBackend::Geometry& g, uint8_t* ckv, uint8_t* sf,
                                 uint8_t* kpe);

// Calls `fn(first, count)` for each run of consecutive values in `entries`
// (entry i maps to buffer row i), so copies can be coalesced.
template <typename Fn>
void ForEachRun(std::span<const int64_t> entries, Fn&& fn) {
  size_t i = 0;
  while (i < entries.size()) {
    size_t j = i + 1;
    while (j < entries.size() && entries[j] == entries[j - 1] + 1) ++j;
    fn(i, j - i);
    i = j;
  }
}

}  // namespace mlakv::server
