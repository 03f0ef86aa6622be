#include "server/backend/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "kernels/cuda_check.h"
#include "kernels/scoped_cuda_device.h"
#include "kernels/nvfp4_format.h"
#include "kernels/quantize_append.h"
#include "spdlog/spdlog.h"

namespace mlakv::server {
namespace {

using format::kCkvDim;
using format::kCkvPackedBytes;
using format::kCkvSfBytes;
using format::kKpeBytes;
using format::kKpeDim;

constexpr size_t kAlign = 256;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

int64_t Entries(const CacheBackend::Geometry& g) { return static_cast<int64_t>(g.num_pages) * g.page_size; }

}  // namespace

CudaBackend::CudaBackend(const Options& options)
    : options_(options),
      // Three helpers (four threads with the worker) bring a 4 MB staging
      // copy from ~0.35 ms to ~0.1 ms on the H200 host; fewer on small hosts.
      copier_(std::make_unique<ParallelCopy>(
          static_cast<int>(std::min<unsigned>(3, std::max(1u, std::thread::hardware_concurrency()) - 1)))) {}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(const Options& options) {
  const Geometry& g = options.geometry;
  if (g.num_layers < 1 || g.num_pages < 1 || g.page_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: num_layers, num_pages and page_size must be >= 1, got ",
                                                   g.num_layers, ", ", g.num_pages, ", ", g.page_size));
  }
  if (!options.device.is_cuda()) return absl::InvalidArgumentError("cuda backend: the device is not a GPU");
  MLAKV_RETURN_IF_ERROR(options.device.CheckExists());
  std::unique_ptr<CudaBackend> backend(new CudaBackend(options));
  MLAKV_RETURN_IF_ERROR(backend->Init());  // the destructor releases what Init got
  return backend;
}

absl::Status CudaBackend::Init() {
  ScopedCudaDevice guard(options_.device.ordinal());
  if (!guard.status().ok()) return guard.status();
  MLAKV_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  const int64_t entries = Entries(options_.geometry);
  for (int32_t l = 0; l < options_.geometry.num_layers; ++l) {
    LayerCaches& c = layers_.emplace_back();
    for (auto [ptr, row_bytes] : {std::pair<uint8_t**, int>{&c.ckv, kCkvPackedBytes}, {&c.sf, kCkvSfBytes},
                                  {&c.kpe, kKpeBytes}}) {
      const size_t bytes = static_cast<size_t>(entries) * row_bytes;
      MLAKV_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(ptr), bytes),
                                 absl::StrCat("cudaMalloc of ", bytes, " bytes (layer ", l, " of ",
                                              options_.geometry.num_layers, ", pool total ", cache_bytes(), ")"));
      MLAKV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(*ptr, 0, bytes, stream_), "cudaMemsetAsync of the cache");
    }
  }
  MLAKV_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&skipped_), sizeof(unsigned int)),
                             "cudaMalloc of the skipped-rows counter");
  MLAKV_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(skipped_, 0, sizeof(unsigned int), stream_),
                             "cudaMemsetAsync of the skipped-rows counter");
  MLAKV_CUDA_RETURN_IF_ERROR(
      cudaHostAlloc(reinterpret_cast<void**>(&skipped_flag_), sizeof(unsigned int), cudaHostAllocMapped),
      "cudaHostAlloc (mapped) of the skipped-rows flag");
  *skipped_flag_ = 0;
  MLAKV_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(reinterpret_cast<void**>(&skipped_flag_dev_), skipped_flag_, 0),
                             "cudaHostGetDevicePointer of the skipped-rows flag");
  for (cudaEvent_t& e : timing_) MLAKV_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e), "cudaEventCreate (timing)");
  MLAKV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "cudaStreamSynchronize after zeroing the caches");
  return absl::OkStatus();
}

CudaBackend::~CudaBackend() {
  ScopedCudaDevice guard(options_.device.ordinal());
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (cudaEvent_t e : timing_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  for (LayerCaches& c : layers_) {
    cudaFree(c.ckv);
    cudaFree(c.sf);
    cudaFree(c.kpe);
  }
  if (skipped_ != nullptr) cudaFree(skipped_);
  if (skipped_flag_ != nullptr) cudaFreeHost(skipped_flag_);
  if (scratch_ != nullptr) cudaFree(scratch_);
  if (pinned_ != nullptr) cudaFreeHost(pinned_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::StatusOr<bool> CudaBackend::EventsComplete(std::span<const void* const> events) {
  ScopedCudaDevice guard(options_.device.ordinal());
  for (const void* ev : events) {
    const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(const_cast<void*>(ev)));
    if (err == cudaErrorNotReady) return false;
    MLAKV_CUDA_RETURN_IF_ERROR(err, "cudaEventQuery on a region's IPC event");
  }
  return true;
}

absl::StatusOr<std::vector<CacheBackend::LayerHandles>> CudaBackend::ExportHandles() const {
  ScopedCudaDevice guard(options_.device.ordinal());
  if (!guard.status().ok()) return guard.status();
  std::vector<LayerHandles> out;
  for (size_t l = 0; l < layers_.size(); ++l) {
    LayerHandles& h = out.emplace_back();
    for (auto [ptr, dst] : {std::pair<uint8_t*, std::string*>{layers_[l].ckv, &h.ckv}, {layers_[l].sf, &h.ckv_sf},
                            {layers_[l].kpe, &h.kpe}}) {
      cudaIpcMemHandle_t handle;
      MLAKV_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, ptr),
                                 absl::StrCat("cudaIpcGetMemHandle of a cache of layer ", l));
      dst->assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
    }
  }
  return out;
}

Device CudaBackend::device() const { return options_.device; }

uint64_t CudaBackend::cache_bytes() const {
  return static_cast<uint64_t>(Entries(options_.geometry)) * format::kEntryBytes *
         options_.geometry.num_layers;
}

absl::Status CudaBackend::EnsureStaging(size_t bytes) {
  if (bytes <= staging_bytes_) return absl::OkStatus();
  const size_t want = std::max(bytes, staging_bytes_ * 2);
  // The stream is idle between calls (each call synchronizes), so the old
  // buffers can go at once.
  if (scratch_ != nullptr) cudaFree(scratch_);
  if (pinned_ != nullptr) cudaFreeHost(pinned_);
  scratch_ = nullptr;
  pinned_ = nullptr;
  pinned_dev_ = nullptr;
  staging_bytes_ = 0;
  MLAKV_CUDA_RETURN_IF_ERROR(cudaHostAlloc(reinterpret_cast<void**>(&pinned_), want, cudaHostAllocMapped),
                             absl::StrCat("cudaHostAlloc of ", want, " bytes of pinned staging"));
  MLAKV_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(reinterpret_cast<void**>(&pinned_dev_), pinned_, 0),
                             "cudaHostGetDevicePointer of the pinned staging");
  MLAKV_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&scratch_), want),
                             absl::StrCat("cudaMalloc of ", want, " bytes of staging"));
  staging_bytes_ = want;
  return absl::OkStatus();
}

// Layout of the staging buffer, per layer: ckv rows, kpe rows, the rows'
// placement by segment (segment_indptr, segment_request, segment_start:
// 3 x segments + 1 ints, no per-row arrays), kv_indptr, kv_indices (each
// 256-byte aligned). The whole buffer goes to the device in one copy, or
// none: a few device rows' kernel reads it in place (ReadsPlacementInPlace).
struct CudaBackend::LayerSlots {
  size_t ckv = 0, kpe = 0, placement = 0, indptr = 0, indices = 0;  // offsets in the staging buffer
  int64_t rows = 0;
  int32_t segments = 0;  // non-empty segments
  // The layer's rows live in device memory, one contiguous run (a CUDA
  // region): the kernel reads them in place, no ckv/kpe slots.
  std::optional<RowSource> direct;
  // An earlier layer with the same placement against the same page table
  // (a decode step's 61 layers): this layer's placement, indptr and indices
  // slots are that layer's, written and validated once. -1: its own.
  int shares_placement_with = -1;
};

namespace {

// The same non-empty runs (count, request, start) in the same order.
bool SamePlacement(std::span<const AppendSegment> a, std::span<const AppendSegment> b) {
  if (a.data() == b.data() && a.size() == b.size()) return true;  // one span shared by the layers
  size_t i = 0, j = 0;
  while (true) {
    while (i < a.size() && a[i].count <= 0) ++i;
    while (j < b.size() && b[j].count <= 0) ++j;
    if (i == a.size() || j == b.size()) return i == a.size() && j == b.size();
    if (a[i].count != b[j].count || a[i].request != b[j].request || a[i].start != b[j].start) return false;
    ++i;
    ++j;
  }
}

template <typename T>
bool SameSpan(std::span<const T> a, std::span<const T> b) {
  return a.data() == b.data() && a.size() == b.size();
}

}  // namespace

// What staging produced for the launch: the params with device pointers,
// the host copies into pinned memory, and the device rows to gather.
struct CudaBackend::StagedAppend {
  struct Gather {
    RowSource rows;
    int32_t count;
    size_t ckv, kpe;  // destinations in scratch_
    size_t esize;
  };
  std::vector<QuantizeAppendParams> params;
  std::vector<CopyJob> host_copies;
  std::vector<Gather> gathers;
  std::vector<const void*> wait_events;
  // The params read placements and page tables from pinned_ itself: no copy
  // of the staging buffer is enqueued (ReadsPlacementInPlace).
  bool placement_in_place = false;
};

// Appends `job` to `jobs`, or extends the last job when `job` continues it
// in both source and destination (the rows of consecutive segments of one
// message or one bytes field: one memcpy instead of one per sequence).
namespace {

void AddCopy(std::vector<CopyJob>* jobs, const CopyJob& job) {
  if (!jobs->empty()) {
    CopyJob& last = jobs->back();
    if (static_cast<uint8_t*>(last.dst) + last.bytes == job.dst &&
        static_cast<const uint8_t*>(last.src) + last.bytes == job.src) {
      last.bytes += job.bytes;
      return;
    }
  }
  jobs->push_back(job);
}

}  // namespace

absl::Status CudaBackend::Append(std::span<const LayerAppend> layers) {
  const bool timed = spdlog::should_log(spdlog::level::debug);
  const auto started = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  std::vector<LayerSlots> slots;
  MLAKV_ASSIGN_OR_RETURN(const size_t total, PlanStaging(layers, &slots));
  if (total == 0) return absl::OkStatus();
  ScopedCudaDevice guard(options_.device.ordinal());
  MLAKV_RETURN_IF_ERROR(guard.status());
  MLAKV_RETURN_IF_ERROR(EnsureStaging(total));
  MLAKV_ASSIGN_OR_RETURN(StagedAppend staged, Stage(layers, slots, ReadsPlacementInPlace(total, slots)));
  if (staged.params.empty()) return absl::OkStatus();
  if (!timed) return Launch(staged, total);
  const auto staged_at = std::chrono::steady_clock::now();
  Timing t;
  const absl::Status s = Launch(staged, total, &t);
  const auto us = [](auto a, auto b) { return std::chrono::duration<double, std::micro>(b - a).count(); };
  float gpu_copies_ms = -1, gpu_kernel_ms = -1;
  if (s.ok() && cudaEventElapsedTime(&gpu_copies_ms, timing_[0], timing_[1]) == cudaSuccess &&
      cudaEventElapsedTime(&gpu_kernel_ms, timing_[1], timing_[2]) == cudaSuccess) {
    spdlog::debug("cuda backend append: layers={} rows={} bytes_staged={} placement={} us: stage={:.1f} enqueue={:.1f} "
                  "sync={:.1f} gpu_to_kernel={:.1f} gpu_kernel={:.1f}",
                  staged.params.size(), staged.params[0].num_rows, total,
                  staged.placement_in_place ? "in_place" : "copied",
                  us(started, staged_at), us(staged_at, t.enqueued), us(t.enqueued, t.synced), gpu_copies_ms * 1e3,
                  gpu_kernel_ms * 1e3);
  }
  return s;
}

absl::StatusOr<size_t> CudaBackend::PlanStaging(std::span<const LayerAppend> layers,
                                               std::vector<LayerSlots>* slots) const {
  const Geometry& g = options_.geometry;
  slots->assign(layers.size(), {});
  size_t total = 0;
  for (size_t li = 0; li < layers.size(); ++li) {
    const LayerAppend& la = layers[li];
    if (la.layer < 0 || la.layer >= g.num_layers) {
      return absl::InternalError(absl::StrCat("cuda backend: layer ", la.layer, " outside [0, ", g.num_layers, ")"));
    }
    if (la.kv_indptr.empty()) return absl::InternalError("cuda backend: empty kv_indptr");
    auto check_device = [&](const RowSource& r) -> absl::Status {
      if (r.on_device() && r.device != options_.device.ordinal()) {
        return absl::InternalError(absl::StrCat("cuda backend on ", options_.device.ToString(), ": rows on cuda:",
                                                r.device, " (the region registry refuses them)"));
      }
      return absl::OkStatus();
    };
    if (la.rows) MLAKV_RETURN_IF_ERROR(check_device(*la.rows));
    int64_t rows = 0;
    int32_t non_empty = 0;
    // The previous layer's segments (the compact form's one list, rows given
    // per layer): counted already, and no rows of their own to check.
    if (li > 0 && la.rows && layers[li - 1].rows && SameSpan(layers[li - 1].segments, la.segments)) {
      rows = (*slots)[li - 1].rows;
      non_empty = (*slots)[li - 1].segments;
    } else {
      for (const AppendSegment& seg : la.segments) {
        if (seg.count <= 0) continue;
        rows += seg.count;
        ++non_empty;
        if (!la.rows) MLAKV_RETURN_IF_ERROR(check_device(seg.rows));
      }
    }
    if (rows > std::numeric_limits<int32_t>::max()) {
      return absl::InternalError(absl::StrCat("cuda backend: ", rows, " rows in one layer exceed int32"));
    }
    const size_t esize = static_cast<size_t>(DTypeSize(la.dtype));
    LayerSlots& s = (*slots)[li];
    s.rows = rows;
    s.segments = non_empty;
    s.direct = ContiguousDeviceRows(la);
    s.ckv = total;
    total += s.direct ? 0 : AlignUp(rows * kCkvDim * esize);
    s.kpe = total;
    total += s.direct ? 0 : AlignUp(rows * kKpeDim * esize);
    // The previous layer's placement, when this one's is the same.
    if (li > 0 && rows > 0) {
      const size_t prev = (*slots)[li - 1].shares_placement_with >= 0 ? (*slots)[li - 1].shares_placement_with : li - 1;
      const LayerAppend& p = layers[prev];
      if ((*slots)[prev].rows == rows && SameSpan(p.kv_indptr, la.kv_indptr) && SameSpan(p.kv_indices, la.kv_indices) &&
          SamePlacement(p.segments, la.segments)) {
        s.shares_placement_with = static_cast<int>(prev);
        s.placement = (*slots)[prev].placement;
        s.indptr = (*slots)[prev].indptr;
        s.indices = (*slots)[prev].indices;
        continue;
      }
    }
    s.placement = total;
    total += AlignUp((3 * static_cast<size_t>(non_empty) + 1) * sizeof(int32_t));
    s.indptr = total;
    total += AlignUp(la.kv_indptr.size() * sizeof(int32_t));
    s.indices = total;
    total += AlignUp(std::max<size_t>(1, la.kv_indices.size()) * sizeof(int32_t));
  }
  return total;
}

// Packs placements and page tables into the pinned buffer, lists the host
// row copies and device-row gathers, and builds the params twice: with host
// pointers (validated here) and with device pointers (launched).
absl::StatusOr<CudaBackend::StagedAppend> CudaBackend::Stage(std::span<const LayerAppend> layers,
                                                             const std::vector<LayerSlots>& slots, bool in_place) {
  const Geometry& g = options_.geometry;
  StagedAppend out;
  out.placement_in_place = in_place;
  // Where the kernel finds the staged placements and page tables: the
  // buffer's device copy, or the pinned buffer as the GPU maps it.
  const uint8_t* placement_base = in_place ? pinned_dev_ : scratch_;
  for (size_t li = 0; li < layers.size(); ++li) {
    const LayerAppend& la = layers[li];
    const LayerSlots& s = slots[li];
    if (s.rows == 0) continue;
    const size_t esize = static_cast<size_t>(DTypeSize(la.dtype));
    const bool own_placement = s.shares_placement_with < 0;  // else written (and validated) with that layer
    auto* seg_indptr = reinterpret_cast<int32_t*>(pinned_ + s.placement);
    int32_t* seg_request = seg_indptr + s.segments + 1;
    int32_t* seg_start = seg_request + s.segments;
    if (own_placement) seg_indptr[0] = 0;
    auto add_waits = [&](const RowSource& rows) {
      for (const void* ev : rows.wait_events) {
        if (ev != nullptr && std::find(out.wait_events.begin(), out.wait_events.end(), ev) == out.wait_events.end()) {
          out.wait_events.push_back(ev);
        }
      }
    };
    // The rows of one segment (or, from `la.rows`, of all of them at once) at
    // row r of the layer: staged from the host, gathered on the device, or
    // read in place by the kernel.
    auto stage_rows = [&](const RowSource& rows, int64_t r, int64_t count) {
      if (rows.on_device()) {
        add_waits(rows);
        if (!s.direct) {
          out.gathers.push_back(
              {rows, static_cast<int32_t>(count), s.ckv + r * kCkvDim * esize, s.kpe + r * kKpeDim * esize, esize});
        }
      } else {
        // One copy per run of host bytes: the rows' one buffer, or each piece
        // of the transport's slices they arrived in.
        for (const bool ckv : {true, false}) {
          uint8_t* dst = pinned_ + (ckv ? s.ckv + r * kCkvDim * esize : s.kpe + r * kKpeDim * esize);
          ForEachHostRun(rows, ckv, count * (ckv ? kCkvDim : kKpeDim) * esize, [&](const char* src, size_t n) {
            AddCopy(&out.host_copies, {dst, src, n});
            dst += n;
          });
        }
      }
    };
    if (la.rows) stage_rows(*la.rows, 0, s.rows);
    // Per segment: its rows (unless `la.rows` had them all) and its placement
    // (unless an earlier layer wrote it): a decode step's 61 layers sharing
    // one placement skip this loop after the first.
    if (own_placement || !la.rows) {
      int32_t n = 0;
      int64_t r = 0;
      for (const AppendSegment& seg : la.segments) {
        if (seg.count <= 0) continue;
        if (!la.rows) stage_rows(seg.rows, r, seg.count);
        r += seg.count;
        if (own_placement) {
          seg_request[n] = seg.request;
          seg_start[n] = seg.start;
          seg_indptr[n + 1] = static_cast<int32_t>(r);
        }
        ++n;
      }
    }
    if (own_placement) {
      std::memcpy(pinned_ + s.indptr, la.kv_indptr.data(), la.kv_indptr.size() * sizeof(int32_t));
      std::memcpy(pinned_ + s.indices, la.kv_indices.data(), la.kv_indices.size() * sizeof(int32_t));
    }

    const LayerCaches& c = layers_[la.layer];
    QuantizeAppendParams p = LayerParams(la, g, c.ckv, c.sf, c.kpe);
    p.num_rows = s.rows;

    QuantizeAppendParams host = p;
    host.append_ckv = pinned_ + s.ckv;
    host.append_kpe = pinned_ + s.kpe;
    host.segment_indptr = seg_indptr;
    host.segment_request = seg_request;
    host.segment_start = seg_start;
    host.num_segments = s.segments;
    host.kv_indptr = reinterpret_cast<const int32_t*>(pinned_ + s.indptr);
    host.kv_indices = reinterpret_cast<const int32_t*>(pinned_ + s.indices);
    if (absl::Status st = own_placement ? ValidateRowPlacement(host) : absl::OkStatus(); !st.ok()) {
      return absl::InternalError(absl::StrCat("cuda backend: row placement rejected (a server bug): ", st.message()));
    }
    if (!CheckDecodeScale(p.ckv_scale, "ckv_scale").ok() || !CheckDecodeScale(p.kpe_scale, "kpe_scale").ok()) {
      return absl::InternalError("cuda backend: scales not positive normal (a server bug)");
    }

    p.append_ckv = scratch_ + s.ckv;
    p.append_kpe = scratch_ + s.kpe;
    if (s.direct) {  // the producer's memory, strides in elements
      p.append_ckv = s.direct->ckv;
      p.append_kpe = s.direct->kpe;
      p.ckv_row_stride = s.direct->ckv_stride_bytes / static_cast<int64_t>(esize);
      p.kpe_row_stride = s.direct->kpe_stride_bytes / static_cast<int64_t>(esize);
    }
    const auto* dev_placement = reinterpret_cast<const int32_t*>(placement_base + s.placement);
    p.segment_indptr = dev_placement;
    p.segment_request = dev_placement + s.segments + 1;
    p.segment_start = dev_placement + 2 * s.segments + 1;
    p.num_segments = s.segments;
    p.kv_indptr = reinterpret_cast<const int32_t*>(placement_base + s.indptr);
    p.kv_indices = reinterpret_cast<const int32_t*>(placement_base + s.indices);
    p.skipped_rows = skipped_;
    p.skipped_flag = skipped_flag_dev_;
    out.params.push_back(p);
  }
  return out;
}

// A call of a few rows from device memory (a decode worker's one-sequence
// append, a one-row IPC append) has nothing to copy to the device but its
// placement and page table (three 256-byte slots): the kernel reads them from the
// pinned buffer itself, which the GPU maps, instead of a DMA enqueued ahead
// of it (a copy operation and its API call less on the call's path). Only
// for a few rows per layer: every block of the kernel reads its segment's
// placement and its pages' indices, over PCIe from there. The buffer is not
// written again before the call's synchronize (the next call stages after
// it), so what the kernel reads is what was staged.
constexpr size_t kInPlacePlacementBytes = 1024;
constexpr int64_t kInPlaceRowsPerLayer = 64;

bool CudaBackend::ReadsPlacementInPlace(size_t total, const std::vector<LayerSlots>& slots) const {
  if (total > kInPlacePlacementBytes || pinned_dev_ == nullptr) return false;
  // Every layer's rows read in place from device memory: nothing of the
  // call but placements goes through the staging buffer (a host or gathered
  // row would not fit in 1 KB anyway; said here, not left implied).
  return std::all_of(slots.begin(), slots.end(), [](const LayerSlots& s) {
    return s.rows == 0 || (s.direct.has_value() && s.rows <= kInPlaceRowsPerLayer);
  });
}

// Copies the rows into pinned staging and the staging buffer to the device
// (unless the kernel reads it in place), waits for the producers' events,
// gathers device rows, launches the kernel for all the call's layers and
// checks that the kernel's bounds guard skipped nothing.
//
// The producers' events are waited for on the host, before anything that
// reads their rows is enqueued, not with cudaStreamWaitEvent: without MPS the server
// and a producer are two contexts that the GPU time-slices, and a stream of
// the server blocked on another process's event sat in those time slices
// while the producer computed (a 4k-token layer-wise save cost the loop
// +3.1-4.8% with the host wait against +6.0-6.1% in the same run; the
// commit's delay after the last layer was the same, docs/performance.md
// "The commit after the last layer"). The worker blocks no longer than
// before: it synchronized on the stream behind the event anyway -- and at
// most Options::source_timeout: the events are polled, not synchronized on,
// so a producer whose event never completes fails the call instead of
// holding the pool. An Append stream's held rows and an AppendBatch's rows
// usually arrive here with their events complete (waited for before, off the
// worker where another task is queued: Pool::WaitForSourcesHere,
// KvCacheService::AppendBatch).
//
// One DMA for the whole staging buffer after the whole host copy: sending a
// 4 MB message's buffer in two halves, the first half's DMA beside the
// second half's copy, made the call slower (336-348 -> 357-382 us on the H200
// host), as did many small DMAs from the copier threads (docs/performance.md
// "Staged chunks sent to the GPU as they are copied", "Ingest: the pool's
// worker").
absl::Status CudaBackend::Launch(const StagedAppend& staged, size_t total, Timing* timing) {
  const absl::Status enqueued = Enqueue(staged, total, timing != nullptr);
  if (timing != nullptr) timing->enqueued = std::chrono::steady_clock::now();
  // Whatever was enqueued completes before the call returns, after an error
  // too: no DMA is left reading the staging buffer or the producer's rows.
  const cudaError_t synced = cudaStreamSynchronize(stream_);
  if (timing != nullptr) timing->synced = std::chrono::steady_clock::now();
  // Read (and cleared) after a failed enqueue too, so that a skip of this
  // call is never reported as the next call's.
  const absl::Status nothing_skipped = synced == cudaSuccess ? CheckNothingSkipped() : absl::OkStatus();
  MLAKV_RETURN_IF_ERROR(enqueued);
  MLAKV_CUDA_RETURN_IF_ERROR(synced, "cudaStreamSynchronize after quantize-append");
  return nothing_skipped;
}

absl::Status CudaBackend::CheckNothingSkipped() {
  // The kernel's store is visible here: the stream was synchronized.
  if (*static_cast<volatile unsigned int*>(skipped_flag_) == 0) return absl::OkStatus();
  *skipped_flag_ = 0;  // before the next launch: a later skip sets it again
  unsigned int total = 0;
  MLAKV_CUDA_RETURN_IF_ERROR(cudaMemcpy(&total, skipped_, sizeof(unsigned int), cudaMemcpyDeviceToHost),
                             "cudaMemcpy of the skipped-rows counter");
  const unsigned int skipped = total - skipped_seen_;  // wraps correctly: unsigned
  skipped_seen_ = total;
  return absl::InternalError(absl::StrCat("cuda backend: the kernel skipped ", skipped,
                                          " out-of-bounds rows that host validation accepted (a server bug)"));
}

absl::Status CudaBackend::Enqueue(const StagedAppend& staged, size_t total, bool timed) {
  if (timed) MLAKV_CUDA_RETURN_IF_ERROR(cudaEventRecord(timing_[0], stream_), "cudaEventRecord (timing)");
  copier_->Copy(staged.host_copies);
  if (!staged.placement_in_place) {
    MLAKV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(scratch_, pinned_, total, cudaMemcpyHostToDevice, stream_),
                               absl::StrCat("cudaMemcpyAsync of ", total, " bytes of staged rows"));
  }
  // The producers' events, polled (a yield between polls) until the limit:
  // nothing of the call is launched when one is late.
  const absl::Time deadline = absl::Now() + options_.source_timeout;
  for (const void* ev : staged.wait_events) {
    cudaEvent_t event = static_cast<cudaEvent_t>(const_cast<void*>(ev));
    for (cudaError_t e = cudaEventQuery(event); e != cudaSuccess; e = cudaEventQuery(event)) {
      if (e != cudaErrorNotReady) {
        MLAKV_CUDA_RETURN_IF_ERROR(e, "cudaEventQuery on a region's IPC event");
      }
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "a producer's CUDA event had not completed ", absl::FormatDuration(options_.source_timeout),
            " (the server's append_idle_timeout_seconds) after the write that reads behind it began; nothing of "
            "this call was written"));
      }
      std::this_thread::yield();
    }
  }
  for (const StagedAppend::Gather& g : staged.gathers) {
    const size_t ckv_row = kCkvDim * g.esize, kpe_row = kKpeDim * g.esize;
    const RowSource& rows = g.rows;
    MLAKV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(scratch_ + g.ckv, ckv_row, rows.ckv, rows.ckv_stride_bytes, ckv_row,
                                                 g.count, cudaMemcpyDeviceToDevice, stream_),
                               absl::StrCat("cudaMemcpy2DAsync of ", g.count, " ckv rows from a CUDA region"));
    MLAKV_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(scratch_ + g.kpe, kpe_row, rows.kpe, rows.kpe_stride_bytes, kpe_row,
                                                 g.count, cudaMemcpyDeviceToDevice, stream_),
                               absl::StrCat("cudaMemcpy2DAsync of ", g.count, " kpe rows from a CUDA region"));
  }
  // Every layer in one launch (up to kMaxLayersPerLaunch a launch).
  if (timed) MLAKV_CUDA_RETURN_IF_ERROR(cudaEventRecord(timing_[1], stream_), "cudaEventRecord (timing)");
  MLAKV_RETURN_IF_ERROR(QuantizeAppendLayers(staged.params.data(), static_cast<int>(staged.params.size()), stream_));
  if (timed) MLAKV_CUDA_RETURN_IF_ERROR(cudaEventRecord(timing_[2], stream_), "cudaEventRecord (timing)");
  return absl::OkStatus();
}

absl::Status CudaBackend::CheckEntries(int32_t layer, std::span<const int64_t> entries) const {
  if (layer < 0 || layer >= options_.geometry.num_layers) {
    return absl::InternalError(absl::StrCat("cuda backend: layer ", layer, " out of range"));
  }
  const int64_t total = Entries(options_.geometry);
  for (int64_t e : entries) {
    if (e < 0 || e >= total) {
      return absl::InternalError(absl::StrCat("cuda backend: cache entry ", e, " outside [0, ", total, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& rows,
                                      bool to_device) {
  MLAKV_RETURN_IF_ERROR(CheckEntries(layer, entries));
  if (entries.empty()) return absl::OkStatus();
  ScopedCudaDevice guard(options_.device.ordinal());
  if (!guard.status().ok()) return guard.status();
  const LayerCaches& c = layers_[layer];
  cudaError_t err = cudaSuccess;
  ForEachRun(entries, [&](size_t i, size_t n) {
    if (err != cudaSuccess) return;
    const int64_t e = entries[i];
    const struct {
      uint8_t* dev;
      uint8_t* host;
      size_t row;
    } parts[3] = {{c.ckv + e * kCkvPackedBytes, rows.ckv_packed + i * kCkvPackedBytes, kCkvPackedBytes},
                  {c.sf + e * kCkvSfBytes, rows.ckv_sf + i * kCkvSfBytes, kCkvSfBytes},
                  {c.kpe + e * kKpeBytes, rows.kpe + i * kKpeBytes, kKpeBytes}};
    for (const auto& part : parts) {
      if (err != cudaSuccess) return;
      err = to_device ? cudaMemcpyAsync(part.dev, part.host, n * part.row, cudaMemcpyHostToDevice, stream_)
                      : cudaMemcpyAsync(part.host, part.dev, n * part.row, cudaMemcpyDeviceToHost, stream_);
    }
  });
  const cudaError_t sync = cudaStreamSynchronize(stream_);
  MLAKV_CUDA_RETURN_IF_ERROR(err, to_device ? "cudaMemcpyAsync of rows to the cache" : "cudaMemcpyAsync of cached rows");
  MLAKV_CUDA_RETURN_IF_ERROR(sync, "cudaStreamSynchronize after copying rows");
  return absl::OkStatus();
}

absl::Status CudaBackend::ReadEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& out) {
  return CopyEntries(layer, entries, out, /*to_device=*/false);
}

absl::Status CudaBackend::WriteEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& in) {
  return CopyEntries(layer, entries, in, /*to_device=*/true);
}

}  // namespace mlakv::server
