#include "server/rpc/server_config.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

#include "google/protobuf/text_format.h"

namespace mlakv::server {
namespace {

v1::ServerConfig Parse(const std::string& text) {
  v1::ServerConfig c;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &c)) << text;
  return c;
}

absl::Status Check(const std::string& text) { return PoolOptionsFromConfig(Parse(text), "cpu").status(); }

TEST(ServerConfigTest, EmbeddedDefault) {
  auto pools = PoolOptionsFromConfig(v1::ServerConfig(), "cpu");
  ASSERT_TRUE(pools.ok()) << pools.status();
  ASSERT_EQ(pools->size(), 1u);
  const Pool::Options& p = pools->front();
  EXPECT_EQ(p.name, "default");
  EXPECT_EQ(p.device, Device::Cpu());
  EXPECT_EQ(p.num_layers, 61);
  EXPECT_EQ(p.page_size, 64);
  EXPECT_EQ(p.num_pages, 256);
  for (const auto& s : p.layer_scales) EXPECT_FALSE(s.has_value());
  EXPECT_EQ(DefaultServerConfig().listen(), "127.0.0.1:50051");
}

TEST(ServerConfigTest, CacheBytesBecomePages) {
  auto pools = PoolOptionsFromConfig(Parse("pools { name: 'p' num_layers: 2 page_size: 16 cache_bytes: 1000000 }"), "cpu");
  ASSERT_TRUE(pools.ok()) << pools.status();
  EXPECT_EQ(pools->front().num_pages, 1000000 / (352 * 16 * 2));
}

TEST(ServerConfigTest, ScalesFromListAndAllLayers) {
  auto pools = PoolOptionsFromConfig(
      Parse("pools { num_layers: 3 num_pages: 4 layer_scales { layer: 2 ckv_scale: 0.5 kpe_scale: 0.25 } "
            "all_layers { ckv_scale: 1 kpe_scale: 2 } }"),
      "cpu");
  ASSERT_TRUE(pools.ok()) << pools.status();
  const auto& s = pools->front().layer_scales;
  ASSERT_TRUE(s[0] && s[1] && s[2]);
  EXPECT_EQ(s[0]->kpe_scale, 2.0f);
  EXPECT_EQ(s[2]->ckv_scale, 0.5f);
}

TEST(ServerConfigTest, IdleTtl) {
  auto pools = PoolOptionsFromConfig(Parse("pools { name: 'p' sequence_idle_ttl_seconds: 30 }"), "cpu");
  ASSERT_TRUE(pools.ok()) << pools.status();
  EXPECT_EQ(pools->front().idle_ttl, absl::Seconds(30));
  EXPECT_EQ(PoolOptionsFromConfig(Parse("pools { name: 'p' }"), "cpu")->front().idle_ttl, absl::ZeroDuration());
}

TEST(ServerConfigTest, EvictionAndLeases) {
  auto pools = PoolOptionsFromConfig(
      Parse("pools { name: 'p' eviction { policy: 'lru' high_watermark: 0.9 low_watermark: 0.75 remember_evicted: 10 } "
            "max_leases: 7 max_leases_per_sequence: 3 max_lease_seconds: 60 default_lease_seconds: 5 }"),
      "cpu");
  ASSERT_TRUE(pools.ok()) << pools.status();
  const Pool::Options& o = pools->front();
  EXPECT_TRUE(o.eviction.lru);
  EXPECT_FLOAT_EQ(o.eviction.high_watermark, 0.9f);
  EXPECT_FLOAT_EQ(o.eviction.low_watermark, 0.75f);
  EXPECT_EQ(o.eviction.remember_ended, 10u);
  EXPECT_EQ(o.max_leases, 7u);
  EXPECT_EQ(o.max_leases_per_sequence, 3u);
  EXPECT_EQ(o.max_lease_duration, absl::Seconds(60));
  EXPECT_EQ(o.default_lease_duration, absl::Seconds(5));
  const Pool::Options d = PoolOptionsFromConfig(Parse("pools { name: 'p' }"), "cpu")->front();
  EXPECT_FALSE(d.eviction.lru) << "eviction is off by default";
  EXPECT_EQ(d.max_leases, 65536u);
  EXPECT_EQ(d.default_lease_duration, absl::Seconds(30));
}

TEST(ServerConfigTest, RejectionsNameTheProblem) {
  struct Case {
    const char* text;
    const char* message;
  } cases[] = {
      {"pools { name: 'p' num_pages: 4 cache_bytes: 100000000 }", "not both"},
      {"pools { name: 'p' cache_bytes: 10 }", "less than one page"},
      {"pools { name: 'p' num_pages: 1 } pools { name: 'p' num_pages: 1 }", "unique"},
      {"pools { num_pages: 1 } pools { name: 'q' num_pages: 1 }", "needs a name"},
      {"pools { name: 'p' device: 'gpu0' }", "not one of auto, cpu, cuda:N"},
      {"pools { name: 'p' num_layers: 2 layer_scales { layer: 2 ckv_scale: 1 kpe_scale: 1 } }", "outside [0, 2)"},
      {"pools { name: 'p' layer_scales { layer: 0 ckv_scale: 0 kpe_scale: 1 } }", "positive normal"},
      {"pools { name: 'p' layer_scales { layer: 0 ckv_scale: 1 kpe_scale: 1 } layer_scales { layer: 0 ckv_scale: 1 "
       "kpe_scale: 1 } }",
       "listed twice"},
      {"pools { name: 'p' all_layers { ckv_scale: -1 kpe_scale: 1 } }", "all_layers"},
      {"pools { name: 'p' page_size: 65536 num_pages: 65536 }", "2^31"},
      {"pools { name: 'p' eviction { policy: 'fifo' } }", "is not \"none\" or \"lru\""},
      {"pools { name: 'p' eviction { high_watermark: 0.9 } }", "need eviction.policy \"lru\""},
      {"pools { name: 'p' eviction { policy: 'lru' high_watermark: 0.5 low_watermark: 0.7 } }", "0 <= low"},
      {"pools { name: 'p' eviction { policy: 'lru' high_watermark: 1.5 } }", "<= 1"},
      {"pools { name: 'p' default_lease_seconds: 100 max_lease_seconds: 10 }", "default_lease_seconds 100"},
  };
  for (const Case& c : cases) {
    absl::Status s = Check(c.text);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.text << ": " << s;
    EXPECT_NE(std::string(s.message()).find(c.message), std::string::npos) << c.text << ": " << s;
  }
}

TEST(ServerConfigTest, CudaDeviceSpelling) {
  // The spellings themselves: tests/server/backend/device_test.cc. Here:
  // the config names the pool and the field.
  for (const char* bad : {"cuda:", "cuda:-1", "cuda: 1", "cuda:+1", "cuda:1x", "cuda:0x1", "cuda", "gpu:0"}) {
    absl::Status s = Check(std::string("pools { name: 'p' device: '") + bad + "' }");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad << ": " << s;
    EXPECT_NE(std::string(s.message()).find("not one of auto, cpu, cuda:N"), std::string::npos) << bad << ": " << s;
  }
}

TEST(ServerConfigTest, GpuThatIsNotThereIsRefusedWhenTheConfigIsRead) {
  // No host has 4096 GPUs: INVALID_ARGUMENT naming the devices there are, or
  // FAILED_PRECONDITION where none is visible (CI).
  absl::Status s = Check("pools { name: 'p' device: 'cuda:4096' }");
  EXPECT_TRUE(s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kFailedPrecondition)
      << s;
  EXPECT_NE(std::string(s.message()).find("pool 'p': device cuda:4096"), std::string::npos) << s;
}

TEST(ServerConfigTest, LoadReportsLineOfSyntaxError) {
  const std::string path = ::testing::TempDir() + "/bad_config.txtpb";
  {
    std::ofstream out(path);
    out << "listen: '127.0.0.1:1'\npools { name: 'p' num_pagez: 3 }\n";
  }
  absl::StatusOr<v1::ServerConfig> c = LoadServerConfig(path);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(c.status().message()).find("line 2"), std::string::npos) << c.status();
  EXPECT_EQ(LoadServerConfig(path + ".missing").status().code(), absl::StatusCode::kNotFound);
  std::remove(path.c_str());
}

TEST(ServerConfigTest, ParseReadsTextAndNamesItsSourceOnError) {
  absl::StatusOr<v1::ServerConfig> c = ParseServerConfig("listen: '127.0.0.1:7'\npools { name: 'p' num_pages: 3 }");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen(), "127.0.0.1:7");
  ASSERT_EQ(c->pools_size(), 1);
  EXPECT_EQ(c->pools(0).num_pages(), 3u);

  c = ParseServerConfig("pools {\n  num_pagez: 3 }", "ConfigMap server.textproto");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(c.status().message())
                .find("ConfigMap server.textproto is not a valid text-format mlakv.v1.ServerConfig: line 2"),
            std::string::npos)
      << c.status();
}

}  // namespace
}  // namespace mlakv::server
