// Shared pieces of the loopback tests: a fixture that starts the real server
// (pools "default": 2 layers x 1024 pages of 16 tokens, "tiny": 2 layers x 4
// pages of 16 tokens), random rows, and the bytes the kernel must store for
// them (computed with the CPU kernel, which the vectors pin).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "client/kv_cache_client.h"
#include "gtest/gtest.h"
#include "kernels/quantize_rows.h"
#include "tests/e2e/server_under_test.h"

namespace mlakv::e2e {

inline constexpr uint32_t kLayers = 2;  // a sequence's length counts every layer: tests write both
inline constexpr uint32_t kPageSize = 16;
inline constexpr uint32_t kPages = 1024;
inline constexpr char kTinyPool[] = "tiny";
inline constexpr uint32_t kTinyPages = 4;
inline constexpr float kCkvScale = 8.0f / (6.0f * 448.0f);
inline constexpr float kKpeScale = 8.0f / 448.0f;

// The server's --device for the suite: $MLAKV_E2E_DEVICE, else "cpu".
std::string SuiteDevice();

// The config above, with `num_layers` layers in the default pool.
std::string TestPoolsConfig(uint32_t num_layers = kLayers);

class E2eTest : public ::testing::Test {
 protected:
  // Starts the server on SuiteDevice(); skips when that is a GPU and none is visible.
  void SetUp() override;
  // Stops the server and expects it to exit 0 (sanitizer reports fail here).
  void TearDown() override;
  void StartServer(const std::string& device, uint32_t num_layers = kLayers);

  // Pool occupancy: checks free + used == total and returns used.
  uint32_t PagesUsed(const std::string& pool = "");

  std::unique_ptr<ServerUnderTest> server_;
  std::unique_ptr<KvCacheClient> client_;
  // Extra server flags for StartServer (a derived fixture sets them before SetUp).
  std::vector<std::string> server_args_;
};

// Random non-zero bf16 rows of one layer (ckv and kpe bytes), named with the
// test scales.
struct TestRows {
  uint32_t rows = 0;
  std::string ckv, kpe;
  static TestRows Random(uint32_t rows, uint64_t seed);
  TestRows Slice(uint32_t first, uint32_t count) const;
  LayerBytes ForLayer(uint32_t layer) const { return {layer, ckv, kpe, kCkvScale, kKpeScale}; }
  // What the cache must hold for these rows (CPU kernel, bf16, test scales).
  QuantizedRows Expected() const;
};

// A StoredLayer as QuantizedRows, for DescribeMismatch.
QuantizedRows AsQuantized(const StoredLayer& stored);

// The ckv_packed / ckv_sf / kpe tensors of a file `mlakv export` wrote; what
// is wrong with it goes to *problem.
QuantizedRows ReadExport(const std::string& path, std::string* problem);

// Append of `rows` at `start` to layers 0 and 1 (every layer of both pools).
AppendRows BothLayersAppend(const std::string& pool, const std::string& sequence, uint32_t start,
                            const TestRows& rows);

// One-layer append of `rows` at `start`.
AppendRows OneLayerAppend(const std::string& pool, const std::string& sequence, uint32_t layer, uint32_t start,
                          const TestRows& rows);

}  // namespace mlakv::e2e
