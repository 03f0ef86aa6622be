// Device checks one GPU can run (ctest label gpu; skipped without a GPU):
// a config naming a GPU the host does not have fails start-up with a message
// that names the device and how many there are, before any pool allocates;
// a pool's worker thread runs with the pool's device current, and creating
// or destroying a pool leaves the caller's current device as it was.
// Pools on two GPUs at once: server_multi_gpu_test.cc.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <future>
#include <string>

#include "kernels/quantize_rows.h"
#include "server/rpc/kv_cache_server.h"
#include "server/rpc/server_config.h"

namespace mlakv::server {
namespace {

KvCacheServer::Options OptionsFor(const v1::ServerConfig& config) {
  KvCacheServer::Options options;
  options.config = config;
  return options;
}

Pool::Options PoolOptions(const std::string& name, const std::string& device) {
  Pool::Options o;
  o.name = name;
  o.device = *Device::Parse(device);
  o.num_layers = 1;
  o.page_size = 16;
  o.num_pages = 4;
  return o;
}

v1::PoolConfig* AddPool(v1::ServerConfig* config, const std::string& name, const std::string& device) {
  v1::PoolConfig* p = config->add_pools();
  p->set_name(name);
  p->set_device(device);
  p->set_num_layers(2);
  p->set_page_size(16);
  p->set_num_pages(8);
  return p;
}

TEST(GpuDeviceTest, ConfigNamingAGpuThatIsNotThereFailsStartUp) {
  const int count = CudaDeviceCount();
  if (count == 0) GTEST_SKIP() << "no CUDA device visible";
  const std::string missing = "cuda:" + std::to_string(count);
  v1::ServerConfig config;
  AddPool(&config, "here", "cuda:0");
  AddPool(&config, "missing", missing);
  absl::StatusOr<std::unique_ptr<KvCacheServer>> server = KvCacheServer::Create(OptionsFor(config));
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << server.status();
  const std::string message(server.status().message());
  EXPECT_NE(message.find("pool 'missing': device " + missing + " does not exist"), std::string::npos) << message;
  EXPECT_NE(message.find("sees " + std::to_string(count) + " CUDA device(s)"), std::string::npos) << message;
  // The same check when the config is read (before any pool allocates) ...
  absl::StatusOr<std::vector<Pool::Options>> options = PoolOptionsFromConfig(config, "cpu");
  EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument) << options.status();
  // ... and for a pool built directly.
  absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::Create(PoolOptions("direct", missing));
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument) << pool.status();
  EXPECT_NE(std::string(pool.status().message()).find("does not exist"), std::string::npos) << pool.status();
}

TEST(GpuDeviceTest, PoolWorkerRunsOnThePoolsDeviceAndTheCallersDeviceStays) {
  const int count = CudaDeviceCount();
  if (count == 0) GTEST_SKIP() << "no CUDA device visible";
  // The last device for the pool, the first for the caller (the same one on a one-GPU host).
  const int pool_device = count - 1;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  {
    absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::Create(PoolOptions("p", "cuda:" + std::to_string(pool_device)));
    ASSERT_TRUE(pool.ok()) << pool.status();
    int d = -1;
    ASSERT_EQ(cudaGetDevice(&d), cudaSuccess);
    EXPECT_EQ(d, 0) << "after creating a pool on cuda:" << pool_device;
    std::promise<int> current;
    (*pool)->worker().Post([&current] {
      int w = -1;
      current.set_value(cudaGetDevice(&w) == cudaSuccess ? w : -1);
    });
    EXPECT_EQ(current.get_future().get(), pool_device);
  }
  int d = -1;
  ASSERT_EQ(cudaGetDevice(&d), cudaSuccess);
  EXPECT_EQ(d, 0) << "after destroying a pool on cuda:" << pool_device;
}

}  // namespace
}  // namespace mlakv::server
