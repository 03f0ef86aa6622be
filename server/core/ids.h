// Process-wide ids: sequence generations and lease ids.
//
// Both come from one 64-bit counter that starts at the process's start time
// in microseconds since the Unix epoch and only goes up, so an id is never
// handed out twice by one server, and a restarted server (whose pools start
// empty) does not hand out the ids of its previous life unless the clock
// went back by more than that life's id count in microseconds. Thread-safe.
#pragma once

#include <cstdint>

namespace mlakv::server {

// The next id; > every id returned before.
uint64_t NextId();

}  // namespace mlakv::server
