// The CUDA quantize-append (label gpu): the reference vectors byte for byte,
// CUDA == CPU (memcmp) on fresh random paged cases across dtypes, page sizes,
// shuffled pages, unordered rows and wide row strides, poisoned caches to
// prove nothing else is written, and the device-side bounds guard.
// Without a visible GPU every test skips and says so.
#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/dequantize.h"
#include "kernels/quantize_append.h"
#include "kernels/quantize_append_config.h"
#include "kernels/quantize_rows.h"
#include "tests/testing/paged_scenario.h"
#include "tests/testing/vector_files.h"

namespace mlakv {
namespace {

using testing::kPoison;
using testing::MakeScenario;
using testing::PagedScenario;
using testing::ScenarioOptions;

#define SKIP_WITHOUT_GPU() \
  if (!testing::HaveCuda()) GTEST_SKIP() << "no CUDA device visible: GPU test not run"

template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(const std::vector<T>& host) : size_(host.size()) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&ptr_), std::max<size_t>(1, size_ * sizeof(T))), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), size_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceVector() { cudaFree(ptr_); }
  T* get() { return ptr_; }
  std::vector<T> ToHost() const {
    std::vector<T> out(size_);
    EXPECT_EQ(cudaMemcpy(out.data(), ptr_, size_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

 private:
  T* ptr_ = nullptr;
  size_t size_;
};

// A host word the device writes through (cudaHostAllocMapped), as the CUDA
// backend's skipped-rows flag is; poisoned so that a stray store shows.
class MappedFlag {
 public:
  static constexpr unsigned int kUnset = 0xA5A5A5A5u;
  MappedFlag() {
    EXPECT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof(unsigned int), cudaHostAllocMapped),
              cudaSuccess);
    *host_ = kUnset;
    EXPECT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0), cudaSuccess);
  }
  ~MappedFlag() { cudaFreeHost(host_); }
  unsigned int* device() const { return device_; }
  unsigned int value() const { return *static_cast<volatile unsigned int*>(host_); }

 private:
  unsigned int* host_ = nullptr;
  unsigned int* device_ = nullptr;
};

// Runs the scenario on the device; returns the device caches, the skip count
// and, where the run passed a skipped-rows flag, the flag's value.
struct CudaRun {
  std::vector<uint8_t> ckv_cache, ckv_sf_cache, kpe_cache;
  unsigned int skipped = 0;
  unsigned int flag = MappedFlag::kUnset;
  absl::Status status;

  // Waits for the device, then copies its caches, skip count and flag here.
  void ReadBack(const DeviceVector<uint8_t>& cc, const DeviceVector<uint8_t>& sf, const DeviceVector<uint8_t>& kc,
                const DeviceVector<unsigned int>& skip_count, const MappedFlag* skip_flag = nullptr) {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ckv_cache = cc.ToHost();
    ckv_sf_cache = sf.ToHost();
    kpe_cache = kc.ToHost();
    skipped = skip_count.ToHost()[0];
    if (skip_flag != nullptr) flag = skip_flag->value();
  }
  // The flag says what the count says: set to 1 when rows were skipped,
  // untouched otherwise.
  bool FlagAgreesWithCount() const { return flag == (skipped != 0 ? 1u : MappedFlag::kUnset); }
};

// With `config`, launches through QuantizeAppendWithConfig instead of the
// public entry (which picks the configuration itself).
CudaRun RunCuda(PagedScenario& s, const QuantizeAppendConfig* config = nullptr) {
  DeviceVector<uint16_t> ckv(s.ckv), kpe(s.kpe);
  DeviceVector<int32_t> batch(s.batch_indices), pos(s.positions), indices(s.kv_indices), indptr(s.kv_indptr),
      last(s.kv_last_page_len);
  DeviceVector<uint8_t> cc(s.ckv_cache), sf(s.ckv_sf_cache), kc(s.kpe_cache);
  DeviceVector<unsigned int> skipped(std::vector<unsigned int>{0});
  MappedFlag flag;
  const int P = s.num_pages, S = s.options.page_size;
  auto i32 = [](DeviceVector<int32_t>& v, size_t n) {
    return TensorView::Contiguous(v.get(), DType::kInt32, {static_cast<int64_t>(n)});
  };
  CudaRun run;
  const TensorView views[] = {
      TensorView::Rows(ckv.get(), s.options.dtype, s.num_rows, 512, s.ckv_row_stride),
      TensorView::Rows(kpe.get(), s.options.dtype, s.num_rows, 64, s.kpe_row_stride), i32(batch, s.num_rows),
      i32(pos, s.num_rows), TensorView::Contiguous(cc.get(), DType::kUInt8, {P, S, 256}),
      TensorView::Contiguous(sf.get(), DType::kFloat8E4M3, {P, S, 32}),
      TensorView::Contiguous(kc.get(), DType::kFloat8E4M3, {P, S, 64}), i32(indices, s.kv_indices.size()),
      i32(indptr, s.kv_indptr.size()), i32(last, s.kv_last_page_len.size())};
  if (config == nullptr) {
    run.status = QuantizeAppendCuda(views[0], views[1], views[2], views[3], views[4], views[5], views[6], views[7],
                                    views[8], views[9], s.ckv_scale, s.kpe_scale, nullptr, skipped.get());
  } else {
    absl::StatusOr<QuantizeAppendParams> params =
        MakeQuantizeAppendParams(views[0], views[1], views[2], views[3], views[4], views[5], views[6], views[7],
                                 views[8], views[9], s.ckv_scale, s.kpe_scale);
    run.status = params.status();
    if (params.ok()) {
      params->skipped_rows = skipped.get();
      params->skipped_flag = flag.device();
      run.status = QuantizeAppendWithConfig(*params, *config, nullptr);
    }
  }
  run.ReadBack(cc, sf, kc, skipped, config != nullptr ? &flag : nullptr);
  return run;
}

class CudaVectorTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaVectorTest, MatchesExpectedBytes) {
  SKIP_WITHOUT_GPU();
  testing::VectorCase c = testing::LoadVectorCase(GetParam());
  absl::StatusOr<QuantizedRows> q =
      QuantizeRows(c.ckv_view(), c.kpe_view(), c.ckv_scale, c.kpe_scale, KernelDevice::kCuda, 0);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(testing::DescribeMismatch(c.expect, *q), "");
}

INSTANTIATE_TEST_SUITE_P(AllFiles, CudaVectorTest, ::testing::ValuesIn(testing::VectorFileNames()),
                         testing::VectorTestName);

struct RandomCase {
  DType dtype;
  int page_size;
  int extra_row_stride;  // 24 keeps 16-byte alignment (vector loads); 3 forces the scalar path
};

class CudaEqualsCpuTest : public ::testing::TestWithParam<RandomCase> {};

TEST_P(CudaEqualsCpuTest, SameBytesAndNothingElseWritten) {
  SKIP_WITHOUT_GPU();
  for (uint32_t seed = 1; seed <= 4; ++seed) {
    ScenarioOptions o;
    o.dtype = GetParam().dtype;
    o.page_size = GetParam().page_size;
    o.extra_row_stride = GetParam().extra_row_stride;
    o.batch = 3 + static_cast<int>(seed) * 3;
    o.max_new_tokens = seed == 4 ? 600 : 90;
    o.seed = seed * 101 + static_cast<uint32_t>(o.page_size);
    PagedScenario s = MakeScenario(o);
    CudaRun gpu = RunCuda(s);
    ASSERT_TRUE(gpu.status.ok()) << gpu.status;
    EXPECT_EQ(gpu.skipped, 0u);
    ASSERT_TRUE(s.RunCpu().ok());  // poisoned host caches, same rows
    ASSERT_EQ(0, std::memcmp(gpu.ckv_cache.data(), s.ckv_cache.data(), s.ckv_cache.size())) << "seed " << seed;
    ASSERT_EQ(0, std::memcmp(gpu.ckv_sf_cache.data(), s.ckv_sf_cache.data(), s.ckv_sf_cache.size())) << "seed " << seed;
    ASSERT_EQ(0, std::memcmp(gpu.kpe_cache.data(), s.kpe_cache.data(), s.kpe_cache.size())) << "seed " << seed;
    // CPU placement is checked against poison in the CPU tests; equality here
    // carries that over. Spare pages exist in every scenario: check them too.
    size_t poisoned = 0;
    for (uint8_t b : gpu.ckv_cache) poisoned += b == kPoison;
    EXPECT_GE(poisoned, static_cast<size_t>(o.spare_pages) * o.page_size * 256);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sweep, CudaEqualsCpuTest,
    ::testing::Values(RandomCase{DType::kBFloat16, 1, 24}, RandomCase{DType::kBFloat16, 16, 24},
                      RandomCase{DType::kBFloat16, 64, 24}, RandomCase{DType::kBFloat16, 128, 24},
                      RandomCase{DType::kFloat16, 1, 24}, RandomCase{DType::kFloat16, 16, 24},
                      RandomCase{DType::kFloat16, 64, 24}, RandomCase{DType::kFloat16, 128, 24},
                      RandomCase{DType::kBFloat16, 64, 3}, RandomCase{DType::kFloat16, 16, 3},
                      RandomCase{DType::kBFloat16, 64, 0}),
    [](const auto& info) {
      return std::string(info.param.dtype == DType::kBFloat16 ? "bf16" : "f16") + "_page" +
             std::to_string(info.param.page_size) + "_pad" + std::to_string(info.param.extra_row_stride);
    });

// Every configuration the launcher or a benchmark can pick writes the same
// bytes (including rows per warp that do not divide the row count).
TEST(CudaConfigs, EveryLaunchConfigurationWritesTheCpuBytes) {
  SKIP_WITHOUT_GPU();
  std::vector<QuantizeAppendConfig> configs;
  for (int rpw : {1, 2, 4, 8}) configs.push_back(QuantizeAppendConfig{rpw, 8, 8});
  configs.push_back(QuantizeAppendConfig{8, 3, 1});  // few, odd-sized blocks: long grid-stride loops
  // Rows dealt to blocks as contiguous ranges: ranges that are not a multiple
  // of the rows per warp (partial groups mid-launch), and 1 row per warp.
  for (int rpw : {1, 8}) configs.push_back(QuantizeAppendConfig{rpw, 8, 8, /*block_ranges=*/true});
  configs.push_back(QuantizeAppendConfig{8, 3, 1, /*block_ranges=*/true});
  // One block of 32 warps per SM (one table fill per SM).
  configs.push_back(QuantizeAppendConfig{8, 32, 1, /*block_ranges=*/true});
  configs.push_back(QuantizeAppendConfig{2, 32, 1});
  configs.push_back(QuantizeAppendConfig{16, 8, 8});
  configs.push_back(QuantizeAppendConfig{16, 5, 2, /*block_ranges=*/true});
  configs.push_back(QuantizeAppendConfig{4, 8, 4, /*block_ranges=*/true});  // the 16k-64k rows default
  for (const DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    ScenarioOptions o;
    o.dtype = dtype;
    o.page_size = 16;
    o.batch = 9;
    o.max_new_tokens = 333;
    PagedScenario cpu = MakeScenario(o);
    ASSERT_TRUE(cpu.RunCpu().ok());
    for (const QuantizeAppendConfig& config : configs) {
      PagedScenario s = MakeScenario(o);
      CudaRun gpu = RunCuda(s, &config);
      ASSERT_TRUE(gpu.status.ok()) << gpu.status;
      const std::string where = "rows_per_warp " + std::to_string(config.rows_per_warp) + " warps " +
                                std::to_string(config.warps_per_block) + (config.block_ranges ? " ranges" : "");
      EXPECT_EQ(gpu.skipped, 0u) << where;
      EXPECT_TRUE(gpu.FlagAgreesWithCount()) << where << ": flag " << gpu.flag;
      EXPECT_EQ(gpu.ckv_cache, cpu.ckv_cache) << where;
      EXPECT_EQ(gpu.ckv_sf_cache, cpu.ckv_sf_cache) << where;
      EXPECT_EQ(gpu.kpe_cache, cpu.kpe_cache) << where;
    }
  }
}

TEST(CudaLarge, GridStrideLoopCoversMoreRowsThanOneWave) {
  SKIP_WITHOUT_GPU();
  ScenarioOptions o;
  o.page_size = 64;
  o.batch = 24;
  o.max_new_tokens = 4000;  // ~48k rows: more than the launcher's resident grid covers at once
  o.random_bit_rows = false;
  PagedScenario s = MakeScenario(o);
  CudaRun gpu = RunCuda(s);
  ASSERT_TRUE(gpu.status.ok()) << gpu.status;
  ASSERT_TRUE(s.RunCpu().ok());
  EXPECT_EQ(gpu.ckv_cache, s.ckv_cache);
  EXPECT_EQ(gpu.ckv_sf_cache, s.ckv_sf_cache);
  EXPECT_EQ(gpu.kpe_cache, s.kpe_cache);
}

// Device-resident indices are not checked on the host: the kernel must skip
// bad rows, count them, and still write every good row.
TEST(CudaBounds, OutOfRangeRowsAreSkippedAndCounted) {
  SKIP_WITHOUT_GPU();
  ScenarioOptions o;
  o.page_size = 16;
  o.seed = 5;
  PagedScenario good = MakeScenario(o);
  PagedScenario bad = MakeScenario(o);
  const int batch = static_cast<int>(bad.kv_indptr.size()) - 1;
  // Row 0: batch index out of range. Row 1: position beyond its pages.
  // Row 2: its page id replaced by num_pages... on a copy of the table only
  // that row uses (give it a page entry of its own by pointing at a fresh
  // request with one bogus page).
  bad.batch_indices[0] = batch + 7;
  bad.positions[1] = 1 << 20;
  bad.kv_indices.push_back(bad.num_pages + 3);
  bad.kv_indptr.push_back(static_cast<int32_t>(bad.kv_indices.size()));
  bad.kv_last_page_len.push_back(1);
  bad.batch_indices[2] = batch;  // the new request whose only page id is out of range
  bad.positions[2] = 0;
  bad.batch_indices[3] = -1;
  CudaRun gpu = RunCuda(bad);
  ASSERT_TRUE(gpu.status.ok()) << gpu.status;
  EXPECT_EQ(gpu.skipped, 4u);
  // The same launch given a host-mapped flag too: set, as the count says.
  const QuantizeAppendConfig config{8, 8, 8};
  CudaRun flagged = RunCuda(bad, &config);
  ASSERT_TRUE(flagged.status.ok()) << flagged.status;
  EXPECT_EQ(flagged.skipped, 4u);
  EXPECT_EQ(flagged.flag, 1u);
  EXPECT_EQ(flagged.ckv_cache, gpu.ckv_cache);
  // Expected: the good scenario with rows 0..3 removed, on the CPU.
  good.batch_indices.erase(good.batch_indices.begin(), good.batch_indices.begin() + 4);
  good.positions.erase(good.positions.begin(), good.positions.begin() + 4);
  good.ckv.erase(good.ckv.begin(), good.ckv.begin() + 4 * good.ckv_row_stride);
  good.kpe.erase(good.kpe.begin(), good.kpe.begin() + 4 * good.kpe_row_stride);
  good.num_rows -= 4;
  ASSERT_TRUE(good.RunCpu().ok());
  EXPECT_EQ(gpu.ckv_cache, good.ckv_cache);
  EXPECT_EQ(gpu.ckv_sf_cache, good.ckv_sf_cache);
  EXPECT_EQ(gpu.kpe_cache, good.kpe_cache);
}

// ---- placement by segment ----------------------------------------------------

// Runs the scenario's segment form on the device through the launcher.
CudaRun RunCudaBySegment(PagedScenario& s) {
  DeviceVector<uint16_t> ckv(s.ckv), kpe(s.kpe);
  DeviceVector<int32_t> indices(s.kv_indices), indptr(s.kv_indptr), seg_indptr(s.segment_indptr),
      seg_request(s.segment_request), seg_start(s.segment_start);
  DeviceVector<uint8_t> cc(s.ckv_cache), sf(s.ckv_sf_cache), kc(s.kpe_cache);
  DeviceVector<unsigned int> skipped(std::vector<unsigned int>{0});
  QuantizeAppendParams p = s.SegmentHostParams();
  p.append_ckv = ckv.get();
  p.append_kpe = kpe.get();
  p.kv_indices = indices.get();
  p.kv_indptr = indptr.get();
  p.segment_indptr = seg_indptr.get();
  p.segment_request = seg_request.get();
  p.segment_start = seg_start.get();
  p.ckv_cache = cc.get();
  p.ckv_sf_cache = sf.get();
  p.kpe_cache = kc.get();
  p.skipped_rows = skipped.get();
  MappedFlag flag;
  p.skipped_flag = flag.device();
  CudaRun run;
  run.status = QuantizeAppend(p, nullptr);
  run.ReadBack(cc, sf, kc, skipped, &flag);
  return run;
}

struct SegmentCase {
  DType dtype;
  int page_size;
  int batch, max_new_tokens;
  bool shuffle_rows, split;
};

class CudaSegmentTest : public ::testing::TestWithParam<SegmentCase> {};

TEST_P(CudaSegmentTest, SameBytesAsTheCpuWithPerRowPlacement) {
  SKIP_WITHOUT_GPU();
  const SegmentCase& c = GetParam();
  ScenarioOptions o;
  o.dtype = c.dtype;
  o.page_size = c.page_size;
  o.batch = c.batch;
  o.max_new_tokens = c.max_new_tokens;
  o.shuffle_rows = c.shuffle_rows;
  o.seed = 21;
  PagedScenario cpu = MakeScenario(o), gpu_case = MakeScenario(o);
  std::mt19937 split_rng(3);
  gpu_case.BuildSegments(c.split ? &split_rng : nullptr);
  ASSERT_TRUE(ValidateRowPlacement(gpu_case.SegmentHostParams()).ok());
  CudaRun gpu = RunCudaBySegment(gpu_case);
  ASSERT_TRUE(gpu.status.ok()) << gpu.status;
  EXPECT_EQ(gpu.skipped, 0u);
  EXPECT_TRUE(gpu.FlagAgreesWithCount()) << "flag " << gpu.flag;
  ASSERT_TRUE(cpu.RunCpu().ok());
  EXPECT_EQ(gpu.ckv_cache, cpu.ckv_cache);
  EXPECT_EQ(gpu.ckv_sf_cache, cpu.ckv_sf_cache);
  EXPECT_EQ(gpu.kpe_cache, cpu.kpe_cache);
}

// Large cases reach the launcher's 8-rows-per-warp configuration (>= 16384 rows).
INSTANTIATE_TEST_SUITE_P(Forms, CudaSegmentTest,
                         ::testing::Values(SegmentCase{DType::kBFloat16, 64, 12, 4000, false, false},
                                           SegmentCase{DType::kFloat16, 16, 12, 4000, false, true},
                                           SegmentCase{DType::kBFloat16, 1, 5, 70, false, true},
                                           SegmentCase{DType::kFloat16, 37, 5, 70, true, false},
                                           SegmentCase{DType::kBFloat16, 16, 256, 1, false, false}),
                         [](const auto& info) {
                           const SegmentCase& c = info.param;
                           return std::string(c.dtype == DType::kBFloat16 ? "bf16" : "f16") + "_page" +
                                  std::to_string(c.page_size) + "_batch" + std::to_string(c.batch) + "_upto" +
                                  std::to_string(c.max_new_tokens) + (c.shuffle_rows ? "_shuffled" : "") +
                                  (c.split ? "_split" : "");
                         });

// A segment naming a request outside the batch: its rows are skipped and
// counted, every other row written as the CPU writes it.
TEST(CudaSegmentBounds, BadSegmentIsSkippedAndCounted) {
  SKIP_WITHOUT_GPU();
  ScenarioOptions o;
  o.page_size = 16;
  o.shuffle_rows = false;
  o.seed = 9;
  PagedScenario gpu_case = MakeScenario(o), cpu = MakeScenario(o);
  gpu_case.BuildSegments();
  cpu.BuildSegments();
  const int32_t bad_rows = gpu_case.segment_indptr[1] - gpu_case.segment_indptr[0];
  ASSERT_GT(bad_rows, 0);
  gpu_case.segment_request[0] = static_cast<int32_t>(gpu_case.kv_indptr.size()) + 4;
  cpu.segment_request[0] = gpu_case.segment_request[0];
  EXPECT_FALSE(ValidateRowPlacement(cpu.SegmentHostParams()).ok());
  CudaRun gpu = RunCudaBySegment(gpu_case);
  ASSERT_TRUE(gpu.status.ok()) << gpu.status;
  EXPECT_EQ(gpu.skipped, static_cast<unsigned>(bad_rows));
  EXPECT_EQ(gpu.flag, 1u);
  QuantizeAppendHost(cpu.SegmentHostParams(), 1);  // unvalidated: skips the same rows
  EXPECT_EQ(gpu.ckv_cache, cpu.ckv_cache);
  EXPECT_EQ(gpu.ckv_sf_cache, cpu.ckv_sf_cache);
  EXPECT_EQ(gpu.kpe_cache, cpu.kpe_cache);
}

// One layer's scenario on the device, by segment, for QuantizeAppendLayers.
struct DeviceLayer {
  explicit DeviceLayer(PagedScenario& s)
      : ckv(s.ckv), kpe(s.kpe), indices(s.kv_indices), indptr(s.kv_indptr), seg_indptr(s.segment_indptr),
        seg_request(s.segment_request), seg_start(s.segment_start), cc(s.ckv_cache), sf(s.ckv_sf_cache),
        kc(s.kpe_cache) {
    params = s.SegmentHostParams();
    params.append_ckv = ckv.get();
    params.append_kpe = kpe.get();
    params.kv_indices = indices.get();
    params.kv_indptr = indptr.get();
    params.segment_indptr = seg_indptr.get();
    params.segment_request = seg_request.get();
    params.segment_start = seg_start.get();
    params.ckv_cache = cc.get();
    params.ckv_sf_cache = sf.get();
    params.kpe_cache = kc.get();
  }
  DeviceVector<uint16_t> ckv, kpe;
  DeviceVector<int32_t> indices, indptr, seg_indptr, seg_request, seg_start;
  DeviceVector<uint8_t> cc, sf, kc;
  QuantizeAppendParams params;
};

// All layers in one launch (grid row = layer) write exactly what one launch
// per layer writes, whatever each layer's rows, pages, page size and row
// stride: 3 layers; 70 (two launches: 64 + 6); a layer with no rows; a
// float16 layer among bfloat16 ones (launched on its own); some layers' rows
// not 16-byte aligned (the scalar path). With `config`, through
// QuantizeAppendLayersWithConfig.
void ExpectLayersLaunchWritesWhatOneLaunchPerLayerWrites(const QuantizeAppendConfig* config) {
  for (const int layers : {3, 70}) {
    std::vector<PagedScenario> cpu, gpu_cases;
    for (int l = 0; l < layers; ++l) {
      ScenarioOptions o;
      o.page_size = (l % 3 == 0) ? 16 : (l % 3 == 1) ? 1 : 64;
      o.batch = 1 + l % 7;
      o.max_new_tokens = l == 1 ? 3000 : 1 + (l * 13) % 40;  // one layer big enough for 8 rows per lookup
      o.extra_row_stride = l % 5 == 2 ? 3 : 24;  // some layers take the scalar path
      o.dtype = (layers == 3 && l == 2) ? DType::kFloat16 : DType::kBFloat16;
      o.seed = 500 + l;
      cpu.push_back(MakeScenario(o));
      gpu_cases.push_back(MakeScenario(o));
      gpu_cases.back().BuildSegments();
    }
    std::vector<std::unique_ptr<DeviceLayer>> dev;
    std::vector<QuantizeAppendParams> params;
    DeviceVector<unsigned int> skipped(std::vector<unsigned int>{0});
    for (int l = 0; l < layers; ++l) {
      dev.push_back(std::make_unique<DeviceLayer>(gpu_cases[l]));
      dev.back()->params.skipped_rows = skipped.get();
      params.push_back(dev.back()->params);
    }
    params[layers - 1].num_rows = 0;  // the last layer: nothing to write, its caches untouched
    const absl::Status st = config != nullptr ? QuantizeAppendLayersWithConfig(params.data(), layers, *config, nullptr)
                                              : QuantizeAppendLayers(params.data(), layers, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(skipped.ToHost()[0], 0u);
    for (int l = 0; l < layers; ++l) {
      if (l != layers - 1) {
        ASSERT_TRUE(cpu[l].RunCpu().ok());
      }
      EXPECT_EQ(dev[l]->cc.ToHost(), cpu[l].ckv_cache) << layers << " layers, layer " << l;
      EXPECT_EQ(dev[l]->sf.ToHost(), cpu[l].ckv_sf_cache) << layers << " layers, layer " << l;
      EXPECT_EQ(dev[l]->kc.ToHost(), cpu[l].kpe_cache) << layers << " layers, layer " << l;
    }
  }
}

TEST(CudaLayersLaunch, WritesWhatOneLaunchPerLayerWrites) {
  SKIP_WITHOUT_GPU();
  ExpectLayersLaunchWritesWhatOneLaunchPerLayerWrites(nullptr);
}

// The configurations a layers launch can be given write the same bytes:
// one, 2 and 8 rows per lookup (the defaults for decode steps), 16, and few
// small blocks (a long grid-stride loop per layer).
TEST(CudaLayersLaunch, EveryConfigurationWritesWhatOneLaunchPerLayerWrites) {
  SKIP_WITHOUT_GPU();
  for (const QuantizeAppendConfig& config : {QuantizeAppendConfig{1, 8, 8}, QuantizeAppendConfig{2, 8, 8},
                                             QuantizeAppendConfig{8, 8, 8},
                                             QuantizeAppendConfig{16, 8, 4}, QuantizeAppendConfig{8, 3, 1}}) {
    SCOPED_TRACE(::testing::Message() << "rows_per_warp " << config.rows_per_warp << " warps "
                                      << config.warps_per_block << " blocks_per_sm " << config.blocks_per_sm);
    ExpectLayersLaunchWritesWhatOneLaunchPerLayerWrites(&config);
  }
}


TEST(CudaDequantize, MatchesCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  ScenarioOptions o;
  o.page_size = 1;
  o.batch = 1;
  o.max_prefix_tokens = 0;
  o.max_new_tokens = 300;
  o.spare_pages = 0;
  o.shuffle_rows = false;
  PagedScenario s = MakeScenario(o);
  ASSERT_TRUE(s.RunCpu().ok());
  // Contiguous rows: gather by page id (page size 1: entry == page id).
  QuantizedRows q;
  q.rows = s.num_rows;
  for (int64_t i = 0; i < s.num_rows; ++i) {
    const int64_t e = s.kv_indices[s.positions[i]];
    q.ckv_packed.insert(q.ckv_packed.end(), &s.ckv_cache[e * 256], &s.ckv_cache[e * 256 + 256]);
    q.ckv_sf.insert(q.ckv_sf.end(), &s.ckv_sf_cache[e * 32], &s.ckv_sf_cache[e * 32 + 32]);
    q.kpe.insert(q.kpe.end(), &s.kpe_cache[e * 64], &s.kpe_cache[e * 64 + 64]);
  }
  const DequantizedRows cpu = DequantizeRows(q, s.ckv_scale, s.kpe_scale);
  DeviceVector<uint8_t> dp(q.ckv_packed), dsf(q.ckv_sf), dk(q.kpe);
  DeviceVector<float> oc(std::vector<float>(cpu.ckv.size(), -1.0f)), ok(std::vector<float>(cpu.kpe.size(), -1.0f));
  DequantizeParams p;
  p.ckv_packed = dp.get();
  p.ckv_sf = dsf.get();
  p.kpe = dk.get();
  p.num_rows = q.rows;
  p.out_ckv = oc.get();
  p.out_kpe = ok.get();
  p.ckv_scale = s.ckv_scale;
  p.kpe_scale = s.kpe_scale;
  ASSERT_TRUE(DequantizeCuda(p, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> gc = oc.ToHost(), gk = ok.ToHost();
  ASSERT_EQ(0, std::memcmp(gc.data(), cpu.ckv.data(), gc.size() * 4));
  ASSERT_EQ(0, std::memcmp(gk.data(), cpu.kpe.data(), gk.size() * 4));
}

}  // namespace
}  // namespace mlakv
