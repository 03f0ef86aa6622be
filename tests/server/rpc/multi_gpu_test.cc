// Pools on several GPUs of one host (ctest labels gpu and multigpu; every
// test skips itself, saying how many GPUs it saw, with fewer than two).
//
// An in-process server with pool "g0" on cuda:0, "g1" on cuda:1 and "host"
// on the cpu backend, all of one geometry:
//  * each pool's worker thread has its pool's device current, and creating
//    or destroying pools leaves the caller's current device as it was; a
//    server whose only pool is on cuda:1 never creates a context on cuda:0;
//  * appends to g0 and g1 from two threads at once (streams of several
//    messages, then AppendBatch decode steps) store exactly the bytes the cpu
//    backend stores for the same rows;
//  * a CUDA region on cuda:1 (a producer process allocating there) feeds the
//    pool on cuda:0 -- packed rows read in place by the kernel, strided rows,
//    an AppendBatch gathered device to device, the producer's event waited
//    on -- or, where cuda:0 cannot reach cuda:1 (no peer access), the append
//    is FAILED_PRECONDITION naming both devices and the server keeps serving;
//  * ExportPool of each pool names its device, and a decode-side process
//    opening the handles on that device finds the stored bytes.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <future>
#include <string>
#include <thread>
#include <vector>

#include "kernels/quantize_rows.h"
#include "kernels/scoped_cuda_device.h"
#include "tests/server/rpc/ipc_producer_process.h"
#include "tests/server/rpc/region_helpers.h"
#include "tests/server/rpc/service_fixture.h"

namespace mlakv::server::testing {
namespace {

constexpr char kGeometry[] = "num_layers: 4 page_size: 16 num_pages: 256";

// GTEST_SKIP's reason when fewer than two GPUs are visible, else "".
std::string NeedTwoGpus() {
  const int n = CudaDeviceCount();
  return n >= 2 ? "" : "needs two CUDA devices; " + std::to_string(n) + " visible";
}

KvCacheServer::Options OptionsFor(const v1::ServerConfig& config) {
  KvCacheServer::Options options;
  options.config = config;
  return options;
}

class MultiGpuTest : public ::testing::Test, public ServiceFixture {
 protected:
  void SetUp() override {
    if (std::string why = NeedTwoGpus(); !why.empty()) GTEST_SKIP() << why;
    set_allow_ipc(true);
    StartServer("cuda:0", std::string("name: 'g0' ") + kGeometry,
                std::string("pools { name: 'g1' device: 'cuda:1' ") + kGeometry + " } " +
                    "pools { name: 'host' device: 'cpu' " + kGeometry + " }");
  }
  void TearDown() override {
    if (IsSkipped()) return;
    for (const auto& p : server().pools()) {
      absl::Status inv = p->CheckInvariants();
      EXPECT_TRUE(inv.ok()) << p->name() << ": " << inv;
    }
    StopServer();
  }

  Pool& PoolNamed(const std::string& name) {
    for (const auto& p : server().pools()) {
      if (p->name() == name) return *p;
    }
    ADD_FAILURE() << "no pool " << name;
    return *server().pools().front();
  }

  // One stream of messages of at most `per_message` rows into `pool`.
  grpc::Status AppendTo(const std::string& pool, const std::string& sequence, uint32_t start, const Rows& rows,
                        const std::vector<uint32_t>& layers, int64_t per_message = 1 << 30) {
    std::vector<v1::AppendRequest> messages;
    for (int64_t first = 0; first < rows.n; first += per_message) {
      const int64_t count = std::min<int64_t>(per_message, rows.n - first);
      messages.push_back(AppendMessage(messages.empty() ? sequence : "", static_cast<uint32_t>(start + first), rows,
                                       first, count, layers, kCkvScale, kKpeScale));
    }
    messages.front().set_pool(pool);
    return Append(messages);
  }

  grpc::Status AppendBatch(const v1::AppendBatchRequest& req) {
    grpc::ClientContext ctx;
    v1::AppendBatchResponse resp;
    return stub().AppendBatch(&ctx, req, &resp);
  }

  grpc::Status RegisterCuda(const std::string& name, const IpcProducerProcess& producer, uint64_t bytes,
                            bool with_event) {
    v1::RegisterCudaRegionRequest req;
    req.set_name(name);
    req.set_raw_handle(producer.mem_handle());
    req.set_device_id(producer.device());
    req.set_byte_size(bytes);
    if (with_event) req.set_raw_event_handle(producer.event_handle());
    grpc::ClientContext ctx;
    v1::Region out;
    return stub().RegisterCudaRegion(&ctx, req, &out);
  }

};

TEST_F(MultiGpuTest, EachPoolWorkerRunsOnItsPoolsDevice) {
  for (const auto& [name, device] : {std::pair<std::string, int>{"g0", 0}, {"g1", 1}}) {
    grpc::ClientContext ctx;
    v1::GetPoolRequest req;
    req.set_pool(name);
    v1::Pool out;
    grpc::Status s = stub().GetPool(&ctx, req, &out);
    ASSERT_TRUE(s.ok()) << Describe(s);
    EXPECT_EQ(out.device(), "cuda:" + std::to_string(device));
    std::promise<int> current;
    PoolNamed(name).worker().Post([&current] {
      int d = -1;
      current.set_value(cudaGetDevice(&d) == cudaSuccess ? d : -1);
    });
    EXPECT_EQ(current.get_future().get(), device) << "the worker of pool " << name;
  }
}

TEST(MultiGpuServerTest, CreatingAndDestroyingPoolsLeavesTheCallersDeviceCurrent) {
  if (std::string why = NeedTwoGpus(); !why.empty()) GTEST_SKIP() << why;
  for (int caller : {1, 0}) {
    ASSERT_EQ(cudaSetDevice(caller), cudaSuccess);
    v1::ServerConfig config;
    for (int d : {0, 1}) {
      v1::PoolConfig* p = config.add_pools();
      p->set_name("p" + std::to_string(d));
      p->set_device("cuda:" + std::to_string(d));
      p->set_num_layers(2);
      p->set_page_size(16);
      p->set_num_pages(8);
    }
    absl::StatusOr<std::unique_ptr<KvCacheServer>> server = KvCacheServer::Create(OptionsFor(config));
    ASSERT_TRUE(server.ok()) << server.status();
    int d = -1;
    ASSERT_EQ(cudaGetDevice(&d), cudaSuccess);
    EXPECT_EQ(d, caller) << "after creating pools on cuda:0 and cuda:1";
    for (const auto& pool : (*server)->pools()) {
      absl::StatusOr<std::vector<CacheBackend::LayerHandles>> h = pool->ExportHandles();
      EXPECT_TRUE(h.ok()) << h.status();
    }
    ASSERT_EQ(cudaGetDevice(&d), cudaSuccess);
    EXPECT_EQ(d, caller) << "after exporting handles of both pools";
    server->reset();
    ASSERT_EQ(cudaGetDevice(&d), cudaSuccess);
    EXPECT_EQ(d, caller) << "after destroying the pools";
  }
}

class PoolOnCuda1Test : public ::testing::Test, public ServiceFixture {};

TEST_F(PoolOnCuda1Test, ServingPoolsOnlyOnCuda1NeverInitializesCuda0) {
  if (std::string why = NeedTwoGpus(); !why.empty()) GTEST_SKIP() << why;
  if (ScopedCudaDevice::PrimaryContextActive(0)) {
    GTEST_SKIP() << "cuda:0 was initialized earlier in this process; run this test alone (as ctest does)";
  }
  set_allow_ipc(true);
  StartServer("cuda:1", std::string("name: 'only1' ") + kGeometry);
  const Rows rows = RandomRows(50, 41);
  grpc::Status s = AppendRows("s", 0, rows, {0, 3}, kCkvScale, kKpeScale, 20);
  ASSERT_TRUE(s.ok()) << Describe(s);
  Stored stored = Read("s", 3, 0, 50);
  ASSERT_TRUE(stored.status.ok()) << Describe(stored.status);
  v1::ExportPoolResponse exp;
  grpc::ClientContext ctx;
  s = stub().ExportPool(&ctx, v1::ExportPoolRequest(), &exp);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(exp.device_id(), 1);
  StopServer();
  EXPECT_FALSE(ScopedCudaDevice::PrimaryContextActive(0))
      << "a server whose only pool is on cuda:1 created a context on cuda:0";
}

TEST_F(MultiGpuTest, ConcurrentAppendsOnTwoDevicesStoreTheCpuBackendsBytes) {
  constexpr int kSequences = 6;
  constexpr int kDecodeSteps = 3;
  auto rows_of = [](int i) {
    return RandomRows(150 + 17 * i, 100 + i, i % 2 == 0 ? DType::kBFloat16 : DType::kFloat16);
  };
  // Prefill streams of several messages, then AppendBatch decode steps of one
  // row for every sequence; returns every status.
  auto work = [&](const std::string& pool) {
    std::vector<grpc::Status> statuses;
    for (int i = 0; i < kSequences; ++i) {
      statuses.push_back(AppendTo(pool, "s" + std::to_string(i), 0, rows_of(i), {0, 1, 2, 3}, 40));
    }
    for (int step = 0; step < kDecodeSteps; ++step) {
      v1::AppendBatchRequest req;
      req.set_pool(pool);
      req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
      for (int i = 0; i < kSequences; ++i) {
        const Rows one = RandomRows(1, 1000 + 10 * step + i);
        v1::SequenceRows* sr = req.add_sequences();
        sr->set_sequence("s" + std::to_string(i));
        sr->set_start(static_cast<uint32_t>(rows_of(i).n + step));
        sr->set_row_count(1);
        for (uint32_t l = 0; l < 4; ++l) {
          v1::LayerRows* lr = sr->add_layers();
          lr->set_layer(l);
          lr->set_ckv(one.ckv_bytes());
          lr->set_kpe(one.kpe_bytes());
        }
      }
      statuses.push_back(AppendBatch(req));
    }
    return statuses;
  };
  std::future<std::vector<grpc::Status>> on0 = std::async(std::launch::async, work, "g0");
  std::future<std::vector<grpc::Status>> on1 = std::async(std::launch::async, work, "g1");
  const std::vector<std::vector<grpc::Status>> results = {on0.get(), on1.get(), work("host")};
  for (size_t p = 0; p < results.size(); ++p) {
    for (size_t i = 0; i < results[p].size(); ++i) {
      EXPECT_TRUE(results[p][i].ok()) << "pool " << p << " call " << i << ": " << Describe(results[p][i]);
    }
  }
  for (int i = 0; i < kSequences; ++i) {
    const std::string seq = "s" + std::to_string(i);
    const uint32_t length = static_cast<uint32_t>(rows_of(i).n + kDecodeSteps);
    for (uint32_t l = 0; l < 4; ++l) {
      ExpectSameStored(seq, seq, {l}, length, "g0", "host");
      ExpectSameStored(seq, seq, {l}, length, "g1", "host");
    }
  }
}

TEST_F(MultiGpuTest, RegionOnOneGpuFeedsAPoolOnAnother) {
  // Producer layout on cuda:1: [packed ckv rows][packed kpe rows][strided rows: ckv, kpe, 64 pad].
  const Rows rows = RandomRows(300, 31);
  const ProducerLayout layout = MakeProducerLayout(rows);
  const std::string& bytes = layout.bytes;
  const uint64_t n = rows.n, kpe_off = layout.kpe_off, strided_off = layout.strided_off, stride = layout.stride;
  IpcProducerProcess producer(bytes, /*device=*/1);
  ASSERT_EQ(producer.mem_handle().size(), 64u);
  grpc::Status s = RegisterCuda("on1", producer, bytes.size(), /*with_event=*/true);
  ASSERT_TRUE(s.ok()) << Describe(s);
  s = AppendTo("host", "bytes", 0, rows, {0, 1, 2, 3});
  ASSERT_TRUE(s.ok()) << Describe(s);

  // The region's own device first: a pool on cuda:1 reads it in place.
  s = Append({RegionMessage("same-device", 0, n, rows.dtype, {0}, Ref("on1", 0), Ref("on1", kpe_off), "g1")});
  ASSERT_TRUE(s.ok()) << Describe(s);
  ExpectSameStored("same-device", "bytes", {0}, n, "g1", "host");

  int can_access = 0;
  ASSERT_EQ(cudaDeviceCanAccessPeer(&can_access, 0, 1), cudaSuccess);
  std::printf("cudaDeviceCanAccessPeer(cuda:0 -> cuda:1) = %d\n", can_access);
  s = Append({RegionMessage("packed", 0, n, rows.dtype, {0}, Ref("on1", 0), Ref("on1", kpe_off), "g0")});
  if (can_access == 0) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
    EXPECT_NE(s.error_message().find("cuda:1"), std::string::npos) << Describe(s);
    EXPECT_NE(s.error_message().find("cuda:0"), std::string::npos) << Describe(s);
    s = AppendTo("g0", "still-serving", 0, rows, {0});
    EXPECT_TRUE(s.ok()) << Describe(s);
    return;
  }
  // Packed rows: the kernel on cuda:0 reads cuda:1's memory in place.
  ASSERT_TRUE(s.ok()) << Describe(s);
  ExpectSameStored("packed", "bytes", {0}, n, "g0", "host");
  // Strided rows.
  s = Append({RegionMessage("strided", 0, n, rows.dtype, {1}, Ref("on1", strided_off, stride),
                            Ref("on1", strided_off + kCkvRow, stride), "g0")});
  ASSERT_TRUE(s.ok()) << Describe(s);
  ExpectSameStored("strided", "bytes", {1}, n, "g0", "host");
  // AppendBatch: three sequences of 100 rows, gathered device to device from cuda:1 on cuda:0's stream.
  v1::AppendBatchRequest req;
  req.set_pool("g0");
  req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  for (int i = 0; i < 3; ++i) {
    v1::LayerRows* lr = AddBatchLayer(req, "b" + std::to_string(i), 100, 3);
    *lr->mutable_ckv_ref() = Ref("on1", i * 100 * kCkvRow);
    *lr->mutable_kpe_ref() = Ref("on1", strided_off + i * 100 * stride + kCkvRow, stride);
  }
  s = AppendBatch(req);
  ASSERT_TRUE(s.ok()) << Describe(s);
  Stored all = Read("bytes", 3, 0, n, false, 0, "host");
  ASSERT_TRUE(all.status.ok()) << Describe(all.status);
  for (int i = 0; i < 3; ++i) {
    Stored one = Read("b" + std::to_string(i), 3, 0, 100, false, 0, "g0");
    ASSERT_TRUE(one.status.ok()) << Describe(one.status);
    ExpectRowsOf(one.rows, all.rows, i * 100, 100);
  }
  // Unregistered while no append holds it: the mappings on both devices close.
  s = Unregister("on1");
  EXPECT_TRUE(s.ok()) << Describe(s);
  s = AppendTo("g0", "after-unregister", 0, rows, {2});
  EXPECT_TRUE(s.ok()) << Describe(s);
}

TEST_F(MultiGpuTest, ExportPoolNamesEachPoolsDevice) {
  const Rows rows = RandomRows(40, 23);
  for (const std::string pool : {"g0", "g1", "host"}) {
    grpc::Status s = AppendTo(pool, "dec", 0, rows, {2});
    ASSERT_TRUE(s.ok()) << pool << ": " << Describe(s);
  }
  for (const auto& [pool, device] : {std::pair<std::string, int>{"g0", 0}, {"g1", 1}}) {
    v1::ExportPoolResponse exp;
    {
      grpc::ClientContext ctx;
      v1::ExportPoolRequest req;
      req.set_pool(pool);
      grpc::Status s = stub().ExportPool(&ctx, req, &exp);
      ASSERT_TRUE(s.ok()) << pool << ": " << Describe(s);
    }
    EXPECT_EQ(exp.pool(), pool);
    EXPECT_EQ(exp.device_id(), device) << pool;
    ASSERT_EQ(exp.layers_size(), 4);
    v1::Sequence seq;
    {
      grpc::ClientContext ctx;
      v1::GetSequenceRequest req;
      req.set_pool(pool);
      req.set_sequence("dec");
      grpc::Status s = stub().GetSequence(&ctx, req, &seq);
      ASSERT_TRUE(s.ok()) << Describe(s);
    }
    Stored stored = Read("dec", 2, 0, 40, false, 0, pool);
    ASSERT_TRUE(stored.status.ok()) << Describe(stored.status);
    Stored host = Read("dec", 2, 0, 40, false, 0, "host");
    ASSERT_TRUE(host.status.ok()) << Describe(host.status);
    EXPECT_EQ(stored.rows.ckv_packed, host.rows.ckv_packed) << pool;
    // The decode side opens the handles with the exported device current.
    ASSERT_NO_FATAL_FAILURE(ExpectDecodeSideReads(exp, 2, seq, stored.rows, 40, exp.device_id(), pool));
  }
  // The cpu pool has nothing to export.
  grpc::ClientContext ctx;
  v1::ExportPoolRequest req;
  req.set_pool("host");
  v1::ExportPoolResponse exp;
  EXPECT_EQ(stub().ExportPool(&ctx, req, &exp).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

}  // namespace
}  // namespace mlakv::server::testing
