// The pool against its model (tests/server/core/pool_model.h) over many random
// transaction scripts: the same driver the libFuzzer target runs, here with
// fixed seeds so that every CI run covers thousands of interleavings.
#include "tests/server/core/pool_model.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace mlakv::server::testing {
namespace {

TEST(PoolModel, RandomScriptsAgreeWithTheModel) {
  std::mt19937 gen(20261201);
  for (int i = 0; i < 3000; ++i) {
    std::vector<uint8_t> script(64 + gen() % 700);
    for (uint8_t& b : script) b = static_cast<uint8_t>(gen());
    const absl::Status s = RunPoolScript(script.data(), script.size());
    ASSERT_TRUE(s.ok()) << "script " << i << ": " << s;
  }
}

TEST(PoolModel, ScriptsBiasedTowardsAppendsFillThePool) {
  // Mostly begin / stage / commit, so that capacity limits and rewrites are reached.
  std::mt19937 gen(7);
  const uint8_t ops[] = {0, 1, 2, 4, 1, 2, 4, 3, 8, 7, 5, 6};
  for (int i = 0; i < 1000; ++i) {
    std::vector<uint8_t> script;
    for (int k = 0; k < 120; ++k) {
      script.push_back(ops[gen() % sizeof(ops)]);
      for (int a = 0; a < 6; ++a) script.push_back(static_cast<uint8_t>(gen()));
    }
    const absl::Status s = RunPoolScript(script.data(), script.size());
    ASSERT_TRUE(s.ok()) << "script " << i << ": " << s;
  }
}

TEST(PoolModel, EmptyAndTinyScripts) {
  EXPECT_TRUE(RunPoolScript(nullptr, 0).ok());
  const uint8_t one[] = {1};
  EXPECT_TRUE(RunPoolScript(one, 1).ok());
}

}  // namespace
}  // namespace mlakv::server::testing
