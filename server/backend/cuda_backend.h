// CudaBackend: a pool's caches in device memory, written by the CUDA
// quantize-append kernel (QuantizeAppend launcher of kernels/).
//
// One CUDA stream per pool (per backend). Appended rows, positions and page
// tables are packed into one pinned host buffer, copied to a device scratch
// buffer in one cudaMemcpyAsync (or, for a few device rows, read by the
// kernel from the mapped pinned buffer itself), then one kernel is launched
// for all the call's layers (kMaxLayersPerLaunch a launch); every
// call synchronizes the stream before it returns, so the caller's buffers are
// free again and errors are reported by the call that caused them. Reads and
// restores copy whole runs of consecutive cache entries with cudaMemcpyAsync.
// Every entry point sets the pool's device and restores the caller's.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "server/backend/cache_backend.h"
#include "server/backend/parallel_copy.h"

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;

namespace mlakv::server {

class CudaBackend : public CacheBackend {
 public:
  struct Options {
    Geometry geometry;
    Device device = Device::Cuda(0);  // a GPU
    // Longest Append waits for a producer's event of rows by reference
    // (polled); then DEADLINE_EXCEEDED and nothing of the call is written.
    // The service waits for most such events before (off the pool's worker);
    // this bounds the rest, where cudaEventSynchronize would wait forever.
    absl::Duration source_timeout = absl::Seconds(60);
  };

  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const Options& options);
  ~CudaBackend() override;

  Device device() const override;
  uint64_t cache_bytes() const override;
  absl::Status Append(std::span<const LayerAppend> layers) override;
  absl::Status ReadEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& out) override;
  absl::Status WriteEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& in) override;
  absl::StatusOr<std::vector<LayerHandles>> ExportHandles() const override;
  // cudaEventQuery of each (the producers' IPC events, opened on this pool's device).
  absl::StatusOr<bool> EventsComplete(std::span<const void* const> events) override;

 private:
  struct LayerCaches {
    uint8_t* ckv = nullptr;  // device [num_pages, page_size, 256]
    uint8_t* sf = nullptr;   // device [num_pages, page_size, 32]
    uint8_t* kpe = nullptr;  // device [num_pages, page_size, 64]
  };

  struct LayerSlots;
  struct StagedAppend;

  explicit CudaBackend(const Options& options);
  absl::Status Init();
  // The three steps of Append: where each layer's parts go in the staging
  // buffer (its total size), packing them there, and the device work.
  absl::StatusOr<size_t> PlanStaging(std::span<const LayerAppend> layers, std::vector<LayerSlots>* slots) const;
  // `in_place`: the params read placements and page tables from the pinned
  // buffer itself (ReadsPlacementInPlace), else from its device copy.
  absl::StatusOr<StagedAppend> Stage(std::span<const LayerAppend> layers, const std::vector<LayerSlots>& slots,
                                     bool in_place);
  // When the host finished enqueueing and synchronizing (debug level only).
  struct Timing {
    std::chrono::steady_clock::time_point enqueued, synced;
  };
  absl::Status Launch(const StagedAppend& staged, size_t total, Timing* timing = nullptr);
  // Launch's device work, enqueued on the stream; Launch then waits for it.
  // With `timed`, the timing events are recorded before the copies and
  // around the kernel.
  absl::Status Enqueue(const StagedAppend& staged, size_t total, bool timed);
  // After the stream's synchronize: an InternalError naming the count when
  // the kernel's bounds guard skipped rows since the previous check.
  absl::Status CheckNothingSkipped();
  absl::Status EnsureStaging(size_t bytes);
  // Whether a planned call is small enough for its kernel to read its
  // placement from the pinned buffer, with no copy to the device (see the
  // definition).
  bool ReadsPlacementInPlace(size_t total, const std::vector<LayerSlots>& slots) const;
  absl::Status CheckEntries(int32_t layer, std::span<const int64_t> entries) const;
  // Copies runs between the layer's caches and host rows; `to_device` picks the direction.
  absl::Status CopyEntries(int32_t layer, std::span<const int64_t> entries, const EntryRows& rows, bool to_device);

  Options options_;
  std::vector<LayerCaches> layers_;
  // Staging copies of host rows into pinned memory, spread over a few threads
  // for multi-megabyte appends (the worker's largest cost per 4 MB message).
  std::unique_ptr<ParallelCopy> copier_;
  cudaStream_t stream_ = nullptr;
  uint8_t* pinned_ = nullptr;        // host staging (cudaHostAlloc, mapped)
  uint8_t* pinned_dev_ = nullptr;    // pinned_ as the device addresses it
  uint8_t* scratch_ = nullptr;       // device copy of the staging buffer
  size_t staging_bytes_ = 0;         // capacity of both
  // Rows the kernel's bounds guard skipped, counted since the pool started
  // (never reset), and a host-mapped word the kernel sets when it skips any.
  // A call reads the word after its synchronize, with no copy on the stream;
  // only when it is set is the counter read back (the count for the error)
  // and the word cleared. A read-back of the counter on every call cost
  // ~8 us of a decode step's ~47 us backend call on the H200
  // (docs/performance.md "The backend's share of a decode step").
  unsigned int* skipped_ = nullptr;            // device counter
  unsigned int* skipped_flag_ = nullptr;       // host-mapped (cudaHostAllocMapped)
  unsigned int* skipped_flag_dev_ = nullptr;   // its device address
  unsigned int skipped_seen_ = 0;              // counter value after the previous skip
  // At debug log level only: events recorded on the stream before the
  // staging copy, before the kernel and after it, so that an append's debug
  // line splits its backend time into host staging, enqueue, the wait, and
  // the GPU's own view of the copies and the kernel (a call's GPU time
  // against the kernel alone in another process: docs/performance.md
  // "Where the 262k append's time goes").
  cudaEvent_t timing_[3] = {nullptr, nullptr, nullptr};
};

}  // namespace mlakv::server
