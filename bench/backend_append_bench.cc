// Where the CUDA backend's time goes in a decode step (docs/performance.md
// "The backend's share of a decode step"): CudaBackend::Append of N sequences
// x T tokens x L layers whose rows lie in device memory (as a compact
// AppendBatch by reference hands them over), against the GPU operations it
// issues, timed alone on a stream of this program's own, each followed by a
// cudaStreamSynchronize as the backend's are:
//
//   kernel                 one QuantizeAppendLayers launch, the placement already on the device
//   h2d + kernel           the placement's copy from pinned memory first (the backend's staging DMA)
//   kernel + d2h           the skipped-rows counter's read-back after it
//   h2d + kernel + d2h     all three, what the backend enqueues
//   sync / h2d / d2h       each alone on an idle stream: the floors
//
// Rounds alternate the variants so that the host's drift is shared. Needs a
// GPU; prints what it measured as p50 / p90 in microseconds.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bench/bench_cuda_check.h"
#include "bench/bench_stats.h"
#include "kernels/nvfp4_format.h"
#include "kernels/quantize_append.h"
#include "server/backend/cache_backend.h"
#include "server/backend/cuda_backend.h"
#include "server/backend/device.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(int, sequences, 256, "sequences in the step");
ABSL_FLAG(int, tokens, 1, "rows per sequence per layer (1: a decode step; --sequences 1 --tokens 262144 --layers 1: a prefill chunk)");
ABSL_FLAG(int, layers, 61, "layers in the pool, all written by the step");
ABSL_FLAG(int, iterations, 400, "calls per variant per round");
ABSL_FLAG(int, rounds, 5, "rounds; the variants alternate within a round");
ABSL_FLAG(int, gap_us, 0,
          "sleep between timed calls (untimed): a server's thread idles between RPCs, where back-to-back calls keep "
          "the driver's code and data warm");
ABSL_FLAG(bool, debug_log, false, "log at debug level: the backend's line per Append splits its time (stage, enqueue, sync, GPU)");
ABSL_FLAG(std::string, schedule, "auto", "the context's host wait: auto (the server's), spin, yield or blocking");

namespace mlakv::bench {
namespace {

using server::AppendSegment;
using server::CacheBackend;
using server::CudaBackend;
using server::Device;
using server::LayerAppend;
using server::RowSource;

constexpr char kProgram[] = "backend_append_bench";
constexpr int kPageSize = 64;

struct Variant {
  std::string name;
  std::function<void()> call;
  std::vector<double> us;
};

int Run() {
  const int seqs = absl::GetFlag(FLAGS_sequences), tokens = absl::GetFlag(FLAGS_tokens), layers = absl::GetFlag(FLAGS_layers);
  const int iterations = absl::GetFlag(FLAGS_iterations), rounds = absl::GetFlag(FLAGS_rounds);
  const int gap_us = absl::GetFlag(FLAGS_gap_us);
  if (absl::GetFlag(FLAGS_debug_log)) spdlog::set_level(spdlog::level::debug);
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) Die(kProgram, "no CUDA device visible");
  const std::string schedule = absl::GetFlag(FLAGS_schedule);
  const unsigned flags = schedule == "spin"       ? cudaDeviceScheduleSpin
                         : schedule == "yield"    ? cudaDeviceScheduleYield
                         : schedule == "blocking" ? cudaDeviceScheduleBlockingSync
                         : schedule == "auto"     ? cudaDeviceScheduleAuto
                                                  : ~0u;
  if (flags == ~0u) Die(kProgram, "--schedule must be auto, spin, yield or blocking, got " + schedule);
  CHECK_CUDA(cudaSetDeviceFlags(flags));  // before the context exists
  CHECK_CUDA(cudaSetDevice(0));

  const int n = seqs * tokens;  // rows per layer
  const int pages_per_seq = (tokens + kPageSize - 1) / kPageSize;
  // The step's rows: per layer one range of n rows (ckv then kpe), bf16 ones.
  const size_t ckv_bytes = static_cast<size_t>(n) * format::kCkvDim * 2, kpe_bytes = static_cast<size_t>(n) * format::kKpeDim * 2;
  void* rows_dev = nullptr;
  CHECK_CUDA(cudaMalloc(&rows_dev, (ckv_bytes + kpe_bytes) * layers));
  {
    std::vector<uint16_t> ones((ckv_bytes + kpe_bytes) * layers / 2, 0x3f80);
    CHECK_CUDA(cudaMemcpy(rows_dev, ones.data(), ones.size() * 2, cudaMemcpyHostToDevice));
  }
  auto* base = static_cast<uint8_t*>(rows_dev);

  // Sequence i owns pages [i * pages_per_seq, (i + 1) * pages_per_seq); its rows start at position 0.
  const int pages = seqs * pages_per_seq;
  const CacheBackend::Geometry geometry{.num_layers = layers, .num_pages = pages, .page_size = kPageSize};
  std::vector<int32_t> indptr(seqs + 1), indices(pages);
  for (int i = 0; i <= seqs; ++i) indptr[i] = i * pages_per_seq;
  for (int i = 0; i < pages; ++i) indices[i] = i;
  std::vector<AppendSegment> segments(seqs);
  for (int i = 0; i < seqs; ++i) segments[i] = {.rows = {}, .count = tokens, .request = i, .start = 0};
  std::vector<LayerAppend> step(layers);
  for (int l = 0; l < layers; ++l) {
    uint8_t* layer_rows = base + static_cast<size_t>(l) * (ckv_bytes + kpe_bytes);
    step[l] = {.layer = l,
               .dtype = DType::kBFloat16,
               .segments = segments,
               .rows = RowSource{.ckv = layer_rows,
                                 .kpe = layer_rows + ckv_bytes,
                                 .device = 0,
                                 .ckv_stride_bytes = format::kCkvDim * 2,
                                 .kpe_stride_bytes = format::kKpeDim * 2},
               .kv_indptr = indptr,
               .kv_indices = indices};
  }
  auto backend_or = CudaBackend::Create({.geometry = geometry, .device = Device::Cuda(0)});
  if (!backend_or.ok()) Die(kProgram, std::string(backend_or.status().message()));
  std::unique_ptr<CudaBackend> backend = std::move(*backend_or);

  // The same launch by hand: caches, placement and page table of our own.
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t entries = static_cast<size_t>(pages) * kPageSize;
  // Placement as the backend stages it: segment indptr / request / start, kv_indptr, kv_indices.
  std::vector<int32_t> placement;
  placement.push_back(0);
  for (int i = 0; i < seqs; ++i) placement.push_back((i + 1) * tokens);
  for (int i = 0; i < seqs; ++i) placement.push_back(i);
  for (int i = 0; i < seqs; ++i) placement.push_back(0);
  const size_t seg_words = placement.size();
  placement.insert(placement.end(), indptr.begin(), indptr.end());
  placement.insert(placement.end(), indices.begin(), indices.end());
  const size_t placement_bytes = placement.size() * sizeof(int32_t);
  int32_t* placement_dev = nullptr;
  int32_t* placement_pinned = nullptr;
  unsigned int* counter_dev = nullptr;
  unsigned int* counter_host = nullptr;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&placement_dev), placement_bytes));
  CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&placement_pinned), placement_bytes, cudaHostAllocDefault));
  std::memcpy(placement_pinned, placement.data(), placement_bytes);
  CHECK_CUDA(cudaMemcpy(placement_dev, placement.data(), placement_bytes, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&counter_dev), sizeof(unsigned int)));
  CHECK_CUDA(cudaMemset(counter_dev, 0, sizeof(unsigned int)));
  CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&counter_host), sizeof(unsigned int), cudaHostAllocDefault));
  std::vector<QuantizeAppendParams> params(layers);
  std::vector<void*> caches;
  for (int l = 0; l < layers; ++l) {
    QuantizeAppendParams& p = params[l];
    for (auto [ptr, row] : {std::pair<uint8_t**, int>{&p.ckv_cache, format::kCkvPackedBytes},
                            {&p.ckv_sf_cache, format::kCkvSfBytes}, {&p.kpe_cache, format::kKpeBytes}}) {
      CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(ptr), entries * row));
      caches.push_back(*ptr);
    }
    p.append_ckv = step[l].rows->ckv;
    p.append_kpe = step[l].rows->kpe;
    p.dtype = DType::kBFloat16;
    p.num_rows = n;
    p.segment_indptr = placement_dev;
    p.segment_request = placement_dev + seqs + 1;
    p.segment_start = placement_dev + 2 * seqs + 1;
    p.num_segments = seqs;
    p.num_pages = pages;
    p.page_size = kPageSize;
    p.kv_indptr = placement_dev + seg_words;
    p.kv_indices = placement_dev + seg_words + seqs + 1;
    p.batch_size = seqs;
    p.num_kv_indices = pages;
    p.skipped_rows = counter_dev;
  }
  auto check = [](const absl::Status& s) {
    if (!s.ok()) Die(kProgram, std::string(s.message()));
  };
  auto h2d = [&] {
    CHECK_CUDA(cudaMemcpyAsync(placement_dev, placement_pinned, placement_bytes, cudaMemcpyHostToDevice, stream));
  };
  auto kernel = [&] { check(QuantizeAppendLayers(params.data(), layers, stream)); };
  auto d2h = [&] {
    CHECK_CUDA(cudaMemcpyAsync(counter_host, counter_dev, sizeof(unsigned int), cudaMemcpyDeviceToHost, stream));
  };
  auto sync = [&] { CHECK_CUDA(cudaStreamSynchronize(stream)); };

  std::vector<Variant> variants = {
      {"CudaBackend::Append", [&] { check(backend->Append(step)); }, {}},
      {"kernel", [&] { kernel(), sync(); }, {}},
      {"h2d + kernel", [&] { h2d(), kernel(), sync(); }, {}},
      {"kernel + d2h", [&] { kernel(), d2h(), sync(); }, {}},
      {"h2d + kernel + d2h", [&] { h2d(), kernel(), d2h(), sync(); }, {}},
      {"sync alone", [&] { sync(); }, {}},
      {"h2d alone", [&] { h2d(), sync(); }, {}},
      {"d2h alone", [&] { d2h(), sync(); }, {}},
  };
  for (Variant& v : variants) {  // warm-up: first launches, lazy module loading
    for (int i = 0; i < 20; ++i) v.call();
  }
  for (int r = 0; r < rounds; ++r) {
    for (Variant& v : variants) {
      for (int i = 0; i < iterations; ++i) {
        const Clock::time_point t0 = Clock::now();
        v.call();
        v.us.push_back(Micros(Clock::now() - t0));
        if (gap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
      }
    }
  }
  std::printf("%s: %d sequences x %d tokens x %d layers, rows on cuda:0, placement %zu bytes; %d rounds x %d calls; schedule %s; "
              "gap %d us\n",
              kProgram, seqs, tokens, layers, placement_bytes, rounds, iterations, schedule.c_str(), gap_us);
  std::printf("%-24s %10s %10s %10s\n", "variant", "p50 us", "p90 us", "p99 us");
  for (const Variant& v : variants) {
    const Summary s = Summarize(v.us);
    std::printf("%-24s %10.1f %10.1f %10.1f\n", v.name.c_str(), s.p50, s.p90, s.p99);
  }
  if (*counter_host != 0) Die(kProgram, "the kernel skipped rows: the bench's placement is wrong");
  for (void* c : caches) cudaFree(c);
  cudaFree(placement_dev);
  cudaFreeHost(placement_pinned);
  cudaFree(counter_dev);
  cudaFreeHost(counter_host);
  cudaFree(rows_dev);
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace
}  // namespace mlakv::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return mlakv::bench::Run();
}
