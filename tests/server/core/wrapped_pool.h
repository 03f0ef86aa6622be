// A pool whose backend is wrapped in a test's own ForwardingBackend (one that
// records, alters or fails the calls), with the wrapper at hand.
#pragma once

#include <memory>
#include <utility>

#include <gtest/gtest.h>

#include "server/core/pool.h"

namespace mlakv::server::testing {

template <typename Backend>
struct WrappedPool {
  std::unique_ptr<Pool> pool;  // null if Pool::Create failed (the test has failed then)
  Backend* backend = nullptr;  // owned by the pool
};

template <typename Backend>
WrappedPool<Backend> MakeWrappedPool(Pool::Options options) {
  WrappedPool<Backend> t;
  Backend* made = nullptr;
  options.wrap_backend = [&made](std::unique_ptr<CacheBackend> inner) {
    auto b = std::make_unique<Backend>(std::move(inner));
    made = b.get();
    return b;
  };
  absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::Create(options);
  EXPECT_TRUE(pool.ok()) << pool.status();
  if (pool.ok()) t.pool = std::move(*pool);
  t.backend = made;
  return t;
}

}  // namespace mlakv::server::testing
