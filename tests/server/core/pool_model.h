// A model-checked script of pool transactions: the bytes of `script` are
// decoded into a sequence of operations — begin an append, stage rows
// (valid, with holes, too large, rewriting), commit, abort, free, truncate,
// read back, check — run against a small cpu Pool and, side by side, against
// a plain model of what the pool must then hold (sequences, per-layer
// lengths, the expected stored bytes of every committed position, the pages
// each holds). Every operation's status must be what the model predicts,
// every read must be byte-exact, and CheckInvariants plus
// "pages_used == what the model holds" must hold after every step; an
// aborted append must leave exactly what was there before. Half of the
// transactions are streams by reference: their rows stand in for a CUDA
// region's and Pool::Stage holds their writes until the commit, so the
// order of held and immediate writes is checked by the same reads.
//
// Used by the libFuzzer target tests/fuzz/pool_transactions_fuzz.cc and by
// pool_model_test (thousands of random scripts in the normal test run).
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace mlakv::server::testing {

// OK, or INTERNAL describing the first disagreement between pool and model
// (with the operation's index).
absl::Status RunPoolScript(const uint8_t* data, size_t size);

}  // namespace mlakv::server::testing
