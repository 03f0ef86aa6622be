// Benchmark of quantize-append, against a device-to-device copy of the same
// byte count measured in the same run (the practical floor of a memory-bound
// kernel).
//
//   quantize_append_bench [--device cuda|cpu] [--repeats N] [--sweep] [--same_caches] [--only NAME] [--rows N]
//
// --same_caches: every launch writes the same caches (only the input rows
// rotate), as the benchmark did before 2026-11-29 12:00 UTC.
//
// Bytes per row: 1152 read (bf16/fp16 ckv + kpe) + 8 read (batch index and
// position) + 352 written (256 packed + 32 scales + 64 rope) = 1512. The copy
// moves 1512/2 bytes per row (read + write = 1512). Times are medians over
// --repeats launches after warm-up, each timed with CUDA events, the copy and
// the kernel in alternating rounds; the kernel rotates among several sets of
// input rows and caches (the copy among source/destination pairs) until four
// L2s' worth are in play, so that no case is timed from L2 alone.
#include <cuda_runtime.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_cuda_check.h"
#include "kernels/quantize_append.h"
#include "kernels/quantize_append_config.h"

namespace mlakv {
namespace {


constexpr int64_t kBytesPerRow = 1152 + 8 + mlakv::format::kEntryBytes;
constexpr int64_t kL2Bytes = 60ll << 20;

struct Case {
  std::string name;
  DType dtype;
  int page_size;
  int sequences;
  int tokens_per_sequence;  // rows appended per sequence
  int prefix;               // tokens each sequence already holds
  int layers = 1;           // > 1: one QuantizeAppendLayers launch over that many layers (own rows and caches each)
};

std::vector<Case> Cases() {
  return {
      {"decode_1x1", DType::kBFloat16, 64, 1, 1, 1000},
      {"decode_64x1", DType::kBFloat16, 64, 64, 1, 1000},
      {"decode_512x1", DType::kBFloat16, 64, 512, 1, 1000},
      {"decode_4096x1", DType::kBFloat16, 64, 4096, 1, 1000},
      // Decode steps of the service: N sequences x 1 token into each of 61 layers, one launch.
      {"decode_step_1x1x61", DType::kBFloat16, 64, 1, 1, 1000, 61},
      {"decode_step_32x1x61", DType::kBFloat16, 64, 32, 1, 1000, 61},
      {"decode_step_64x1x61", DType::kBFloat16, 64, 64, 1, 1000, 61},
      {"decode_step_256x1x61", DType::kBFloat16, 64, 256, 1, 1000, 61},
      {"decode_step_1024x1x61", DType::kBFloat16, 64, 1024, 1, 1000, 61},
      // A layer-wise save's final write: every layer of one sequence's prompt
      // held by the Append stream and quantized in one launch at its commit.
      {"save_1x1024x61", DType::kBFloat16, 64, 1, 1024, 0, 61},
      {"save_1x4096x61", DType::kBFloat16, 64, 1, 4096, 0, 61},
      {"save_1x16384x61", DType::kBFloat16, 64, 1, 16384, 0, 61},
      {"prefill_1x4096", DType::kBFloat16, 64, 1, 4096, 0},
      {"prefill_4x4096", DType::kBFloat16, 64, 4, 4096, 0},
      {"prefill_8x4096", DType::kBFloat16, 64, 8, 4096, 0},
      {"prefill_16x4096", DType::kBFloat16, 64, 16, 4096, 0},
      {"prefill_64x4096", DType::kBFloat16, 64, 64, 4096, 0},
      {"prefill_256x4096", DType::kBFloat16, 64, 256, 4096, 0},
      {"prefill_16x4096_f16", DType::kFloat16, 64, 16, 4096, 0},
      {"prefill_16x4096_page1", DType::kBFloat16, 1, 16, 4096, 0},
      {"prefill_16x4096_page16", DType::kBFloat16, 16, 16, 4096, 0},
  };
}

// Random, never-zero fp16/bf16 rows: a hash of the index shaped into a
// roughly gaussian value at row-dependent magnitudes.
__global__ void FillRandomKernel(uint16_t* out, int64_t n, uint32_t seed, bool bf16) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    h *= 0x297A2D39u;
    h ^= h >> 15;
    const float u1 = ((h & 0xFFFF) + 1) / 65537.0f, u2 = ((h >> 16) + 1) / 65537.0f;
    const float g = (u1 + u2 - 1.0f) * 2.0f + (u1 > 0.5f ? 0.01f : -0.01f);
    const float mag = exp2f(static_cast<float>((i / 512) % 13) - 6.0f);
    const float v = g * mag;
    out[i] = bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v)) : __half_as_ushort(__float2half_rn(v));
  }
}

struct Device {
  std::vector<void*> allocations;
  template <typename T>
  T* Alloc(size_t count) {
    void* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(count * sizeof(T), 1)));
    allocations.push_back(p);
    return static_cast<T*>(p);
  }
  ~Device() {
    for (void* p : allocations) cudaFree(p);
  }
};

struct Prepared {
  std::vector<QuantizeAppendParams> rotations;  // same placement, different rows (and caches)
  int64_t rows;
};

Prepared Prepare(const Case& c, Device& dev, std::mt19937& rng, bool same_caches) {
  const int64_t rows = static_cast<int64_t>(c.sequences) * c.tokens_per_sequence;
  const int pages_per_seq = (c.prefix + c.tokens_per_sequence + c.page_size - 1) / c.page_size;
  const int num_pages = c.sequences * pages_per_seq;
  std::vector<int32_t> ids(num_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> indptr(c.sequences + 1), last(c.sequences), batch(rows), pos(rows);
  for (int s = 0; s <= c.sequences; ++s) indptr[s] = s * pages_per_seq;
  for (int s = 0; s < c.sequences; ++s) {
    const int len = c.prefix + c.tokens_per_sequence;
    last[s] = len - (pages_per_seq - 1) * c.page_size;
    for (int t = 0; t < c.tokens_per_sequence; ++t) {
      batch[static_cast<int64_t>(s) * c.tokens_per_sequence + t] = s;
      pos[static_cast<int64_t>(s) * c.tokens_per_sequence + t] = c.prefix + t;
    }
  }
  auto upload = [&dev](const std::vector<int32_t>& v) {
    int32_t* d = dev.Alloc<int32_t>(v.size());
    CHECK_CUDA(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    return d;
  };
  QuantizeAppendParams p;
  p.dtype = c.dtype;
  p.batch_indices = upload(batch);
  p.positions = upload(pos);
  p.num_rows = rows;
  p.kv_indices = upload(ids);
  p.kv_indptr = upload(indptr);
  p.batch_size = c.sequences;
  p.num_kv_indices = num_pages;
  p.num_pages = num_pages;
  p.page_size = c.page_size;
  const size_t entries = static_cast<size_t>(num_pages) * c.page_size;
  auto alloc_caches = [&dev, entries](QuantizeAppendParams& q) {
    q.ckv_cache = dev.Alloc<uint8_t>(entries * 256);
    q.ckv_sf_cache = dev.Alloc<uint8_t>(entries * 32);
    q.kpe_cache = dev.Alloc<uint8_t>(entries * 64);
    CHECK_CUDA(cudaMemset(q.ckv_cache, 0xA5, entries * 256));
  };
  alloc_caches(p);
  p.ckv_scale = 0.02f;
  p.kpe_scale = 0.05f;
  // Rotate inputs (and, unless same_caches, caches: a server appends to each
  // layer's caches in turn) until four L2s' worth of bytes are in play.
  const int64_t rotation_bytes = rows * 1152 + (same_caches ? 0 : static_cast<int64_t>(entries) * 352);
  const int rotations = std::max(
      c.layers, static_cast<int>(std::clamp<int64_t>((4 * kL2Bytes) / rotation_bytes + 1, 1, 64)));
  Prepared out;
  out.rows = rows;
  for (int r = 0; r < rotations; ++r) {
    uint16_t* ckv = dev.Alloc<uint16_t>(rows * 512);
    uint16_t* kpe = dev.Alloc<uint16_t>(rows * 64);
    FillRandomKernel<<<1024, 256>>>(ckv, rows * 512, 17u + r, c.dtype == DType::kBFloat16);
    FillRandomKernel<<<256, 256>>>(kpe, rows * 64, 1017u + r, c.dtype == DType::kBFloat16);
    QuantizeAppendParams q = p;
    q.append_ckv = ckv;
    q.append_kpe = kpe;
    if (r > 0 && !same_caches) alloc_caches(q);
    out.rotations.push_back(q);
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  return out;
}

// Medians of `repeats` timed launches of A and of B (CUDA events around each
// launch). They run in alternating rounds -- a few untimed launches of A,
// then a share of A's timed ones, the same for B, and again -- so that each is
// timed in its own steady state (paying for the write-back of its own earlier
// launches' dirty L2 lines, not the other's: timing them strictly in turn
// made the kernel pay for the copy's 50 MB of writes at 65k rows), while slow
// drift of clocks and temperature reaches both alike.
template <typename A, typename B>
std::pair<double, double> AlternatingMedianMicros(int repeats, A&& launch_a, B&& launch_b) {
  constexpr int kRounds = 5, kWarmupPerRound = 3;
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> a, b;
  auto run = [&](auto&& launch, std::vector<double>& times, int round) {
    const int timed = (repeats + kRounds - 1) / kRounds;
    for (int i = 0; i < kWarmupPerRound; ++i) launch(i);
    for (int i = 0; i < timed && static_cast<int>(times.size()) < repeats; ++i) {
      CHECK_CUDA(cudaEventRecord(start));
      launch(kWarmupPerRound + round * timed + i);
      CHECK_CUDA(cudaEventRecord(stop));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      times.push_back(ms * 1000.0);
    }
  };
  for (int round = 0; round < kRounds; ++round) {
    run(launch_a, a, round);
    run(launch_b, b, round);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  return {a[a.size() / 2], b[b.size() / 2]};
}

int RunCuda(int repeats, bool sweep, bool same_caches, const std::string& only) {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB; median of %d launches each (CUDA events)\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, repeats);
  std::printf("%-24s %9s %10s %9s %10s %9s %7s %8s  %s\n", "case", "rows", "kernel_us", "TB/s", "copy_us", "copy_TB/s",
              "ratio", "%copy", "config");
  std::mt19937 rng(42);
  std::vector<QuantizeAppendConfig> configs = {QuantizeAppendConfig{}};
  if (sweep) {
    configs.clear();
    for (int rpw : {1, 2, 4, 8}) configs.push_back(QuantizeAppendConfig{rpw, 8, 8});
    // Grid shape at 8 rows per warp: blocks per SM (4 of 8 warps are resident at once),
    // block size, and how rows are dealt to warps.
    for (int bps : {2, 3, 4, 6}) configs.push_back(QuantizeAppendConfig{8, 8, bps});
    configs.push_back(QuantizeAppendConfig{8, 4, 8});
    for (int bps : {4, 8}) configs.push_back(QuantizeAppendConfig{8, 8, bps, /*block_ranges=*/true});
    // Whole-SM blocks: one table fill per SM instead of four.
    configs.push_back(QuantizeAppendConfig{8, 32, 1, /*block_ranges=*/true});
    configs.push_back(QuantizeAppendConfig{8, 32, 2});
    // 16 rows per lookup: at 65k rows in one wave, one chain per warp.
    configs.push_back(QuantizeAppendConfig{16, 8, 4, /*block_ranges=*/true});
    configs.push_back(QuantizeAppendConfig{16, 8, 8});
    configs.push_back(QuantizeAppendConfig{16, 8, 4});
    configs.push_back(QuantizeAppendConfig{1, 8, 8, /*block_ranges=*/true});
    // Chunked-prefill sizes (16k-32k rows, issue 16): at 8 rows per lookup
    // and 4 blocks of 8 warps per SM, 16k rows leave half the warps without
    // a group; fewer rows per lookup or smaller blocks give every warp one.
    for (int rpw : {1, 2, 4}) {
      for (int bps : {4, 8}) configs.push_back(QuantizeAppendConfig{rpw, 8, bps, /*block_ranges=*/true});
    }
    configs.push_back(QuantizeAppendConfig{8, 4, 8, /*block_ranges=*/true});
    configs.push_back(QuantizeAppendConfig{4, 4, 8, /*block_ranges=*/true});
    configs.push_back(QuantizeAppendConfig{8, 2, 16, /*block_ranges=*/true});
  }
  for (const Case& c : Cases()) {
    if (!only.empty() && c.name.find(only) == std::string::npos) continue;
    Device dev;
    Prepared prep = Prepare(c, dev, rng, same_caches);
    const int64_t bytes = prep.rows * c.layers * kBytesPerRow;
    // The copy: bytes/2 each way, rotating through a pool at least 4 L2s large.
    const int64_t copy_bytes = bytes / 2;
    const int copy_slots = static_cast<int>(std::clamp<int64_t>((4 * kL2Bytes) / copy_bytes + 1, 1, 64));
    uint8_t* src = dev.Alloc<uint8_t>(copy_bytes * copy_slots);
    uint8_t* dst = dev.Alloc<uint8_t>(copy_bytes * copy_slots);
    CHECK_CUDA(cudaMemset(src, 1, copy_bytes * copy_slots));
    auto copy = [&](int i) {
      const int slot = i % copy_slots;
      CHECK_CUDA(cudaMemcpyAsync(dst + slot * copy_bytes, src + slot * copy_bytes, copy_bytes,
                                 cudaMemcpyDeviceToDevice));
    };
    for (const QuantizeAppendConfig& cfg : configs) {
      const QuantizeAppendConfig used =
          sweep ? cfg : c.layers > 1 ? DefaultQuantizeAppendLayersConfig(prep.rows) : DefaultQuantizeAppendConfig(prep.rows);
      std::vector<QuantizeAppendParams> layers(c.layers);
      auto kernel = [&](int i) {
        absl::Status s;
        if (c.layers == 1) {
          s = QuantizeAppendWithConfig(prep.rotations[i % prep.rotations.size()], used, nullptr);
        } else {
          for (int l = 0; l < c.layers; ++l) layers[l] = prep.rotations[(i + l) % prep.rotations.size()];
          s = QuantizeAppendLayersWithConfig(layers.data(), c.layers, used, nullptr);
        }
        if (!s.ok()) {
          std::fprintf(stderr, "%s\n", s.ToString().c_str());
          std::exit(1);
        }
      };
      const auto [copy_us, us] = AlternatingMedianMicros(repeats, copy, kernel);
      std::printf("%-24s %9lld %10.2f %9.3f %10.2f %9.3f %7.3f %7.1f%%  rpw=%d wpb=%d bps=%d%s\n", c.name.c_str(),
                  static_cast<long long>(prep.rows * c.layers), us, bytes / us / 1e6, copy_us, bytes / copy_us / 1e6,
                  us / copy_us, 100.0 * copy_us / us, used.rows_per_warp, used.warps_per_block, used.blocks_per_sm,
                  used.block_ranges ? " ranges" : "");
    }
    CHECK_CUDA(cudaGetLastError());
  }
  return 0;
}

// The CPU path on host memory: rows/s and GB/s of input rows per thread.
int RunCpu(int repeats, int64_t rows) {
  const int page_size = 64;
  std::mt19937 rng(1);
  std::vector<uint16_t> ckv(rows * 512), kpe(rows * 64);
  std::normal_distribution<float> g(0, 1);
  for (auto* v : {&ckv, &kpe}) {
    for (auto& x : *v) {
      const float f = g(rng) + 0.01f;
      uint32_t u;
      std::memcpy(&u, &f, 4);
      x = static_cast<uint16_t>(u >> 16);
    }
  }
  const int pages = static_cast<int>(rows / page_size);
  std::vector<int32_t> ids(pages), batch(rows, 0), pos(rows), indptr = {0, pages};
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::iota(pos.begin(), pos.end(), 0);
  std::vector<uint8_t> cc(rows * 256), sf(rows * 32), kc(rows * 64);
  QuantizeAppendParams p;
  p.append_ckv = ckv.data();
  p.append_kpe = kpe.data();
  p.dtype = DType::kBFloat16;
  p.batch_indices = batch.data();
  p.positions = pos.data();
  p.num_rows = rows;
  p.ckv_cache = cc.data();
  p.ckv_sf_cache = sf.data();
  p.kpe_cache = kc.data();
  p.num_pages = pages;
  p.page_size = page_size;
  p.kv_indices = ids.data();
  p.kv_indptr = indptr.data();
  p.batch_size = 1;
  p.num_kv_indices = pages;
  p.ckv_scale = 0.02f;
  p.kpe_scale = 0.05f;
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  std::printf("cpu: %lld bf16 rows, page size 64, median of %d runs\n", static_cast<long long>(rows), repeats);
  // Wall time, and for one thread also the thread's CPU time, which a busy
  // shared machine inflates less.
  std::printf("%8s %10s %12s %14s %18s\n", "threads", "wall_ms", "cpu_ms(1t)", "Mrows/s", "GB/s input/thread");
  auto cpu_ms = [] {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
  };
  for (unsigned threads : {1u, hw}) {
    std::vector<double> wall, cpu;
    for (int i = 0; i < repeats + 1; ++i) {
      const double c0 = cpu_ms();
      const auto t0 = std::chrono::steady_clock::now();
      QuantizeAppendHost(p, static_cast<int>(threads));
      const auto t1 = std::chrono::steady_clock::now();
      const double c1 = cpu_ms();
      if (i > 0) {
        wall.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        cpu.push_back(c1 - c0);
      }
    }
    std::sort(wall.begin(), wall.end());
    std::sort(cpu.begin(), cpu.end());
    const double med = wall[wall.size() / 2];
    const double per_thread_ms = threads == 1 ? cpu[cpu.size() / 2] : med;
    std::printf("%8u %10.2f %12.2f %14.3f %18.3f\n", threads, med, threads == 1 ? cpu[cpu.size() / 2] : 0.0,
                rows / med / 1e3, rows * 1152.0 / per_thread_ms / 1e6 / threads);
    if (hw == 1) break;
  }
  return 0;
}

}  // namespace
}  // namespace mlakv

int main(int argc, char** argv) {
  std::string device = "cuda", only;
  int64_t cpu_rows = 16 * 4096;
  int repeats = 50;
  bool sweep = false, same_caches = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--device" && i + 1 < argc) {
      device = argv[++i];
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = std::max(20, std::atoi(argv[++i]));
    } else if (a == "--rows" && i + 1 < argc) {
      cpu_rows = std::max<int64_t>(64, std::atoll(argv[++i]));
    } else if (a == "--sweep") {
      sweep = true;
    } else if (a == "--same_caches") {
      same_caches = true;
    } else if (a == "--only" && i + 1 < argc) {
      only = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--device cuda|cpu] [--repeats N>=20] [--sweep] [--same_caches] [--only CASE] [--rows N (cpu)]\n", argv[0]);
      return 2;
    }
  }
  return device == "cpu" ? mlakv::RunCpu(std::min(repeats, 9), cpu_rows) : mlakv::RunCuda(repeats, sweep, same_caches, only);
}
