// libFuzzer target: the pool's transaction path (begin, stage, commit,
// abort, free, truncate, read) driven by the input bytes and checked against
// a model (tests/server/core/pool_model.h). Any disagreement aborts with the
// model's description of it.
#include <cstdio>
#include <cstdlib>

#include "tests/server/core/pool_model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::Status s = mlakv::server::testing::RunPoolScript(data, size);
  if (!s.ok()) {
    std::fprintf(stderr, "pool model violation: %s\n", s.ToString().c_str());
    std::abort();
  }
  return 0;
}
