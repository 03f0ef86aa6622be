// The Append message and AppendBatch request parses that leave the rows in
// the received slices (server/rpc/append_wire.h), against protobuf's plain
// parse: for any bytes, cut into slices anywhere, read as either message,
// both accept or both refuse, and what both accept is the same message once
// the rows are put back.
//
// Input: byte 0 = number of cuts (mod 8), then one byte per cut (its place,
// scaled to the message), then the message's bytes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "tests/server/rpc/append_wire_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t cuts_n = std::min<size_t>(data[0] % 8, size - 1);
  const std::string bytes(reinterpret_cast<const char*>(data) + 1 + cuts_n, size - 1 - cuts_n);
  std::vector<size_t> cuts;
  for (size_t i = 0; i < cuts_n; ++i) cuts.push_back(bytes.size() * data[1 + i] / 255);
  std::sort(cuts.begin(), cuts.end());
  const std::vector<grpc::Slice> slices = mlakv::server::testing::CutInto(bytes, cuts);
  for (const mlakv::server::testing::WireVerdict& v : {mlakv::server::testing::CompareWithPlainParse(slices),
                                                        mlakv::server::testing::CompareBatchWithPlainParse(slices)}) {
    if (v.plain_ok != v.split_ok) std::abort();
    if (v.plain_ok && !v.same) std::abort();
  }
  return 0;
}
