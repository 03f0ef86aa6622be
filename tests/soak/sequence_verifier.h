// SequenceVerifier: compares what the server holds for a sequence with a
// model, byte for byte: GetSequence's lengths and page table, and every
// stored byte of every layer read back with ReadSequence (RAW, through the
// C++ client's ReadLayer), with the layer's scales. A difference is a
// broken promise; its description names the layer, the token and the part.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/kv_cache_client.h"
#include "tests/soak/sequence_model.h"
#include "tests/soak/soak_options.h"

namespace mlakv::soak {

// What the server holds for one sequence.
struct ServerSequence {
  bool exists = false;
  v1::Sequence meta;                // GetSequence (FULL view)
  std::vector<std::string> layers;  // per layer, the stored entries (when read)
  bool read = false;
};

class SequenceVerifier {
 public:
  SequenceVerifier(KvCacheClient* client, const SoakOptions& options, const PoolGeometry& geometry)
      : client_(client), options_(options), geometry_(geometry) {}

  // GetSequence (NOT_FOUND: exists = false) and, with read_bytes, every
  // written layer read back. An unexpected RPC error is returned as is.
  absl::StatusOr<ServerSequence> Fetch(const std::string& id, bool read_bytes) const;
  // Empty when `server` is exactly `expected` (nullopt: no such sequence);
  // else what differs.
  std::string Diff(const ServerSequence& server, const std::optional<SequenceModel>& expected) const;
  // Fetch + Diff: OK, or a status that describes the violation.
  absl::Status Verify(const std::string& id, const std::optional<SequenceModel>& expected,
                      bool read_bytes = true) const;
  // 0 when the server holds `a`, 1 when `b` (checked in that order); a
  // status describing both differences when neither.
  absl::StatusOr<int> WhichOf(const std::string& id, const std::optional<SequenceModel>& a,
                              const std::optional<SequenceModel>& b) const;

  // A Sequence message (GetSequence, a FULL or BASIC append response, a
  // truncate response) against the model; `pages_before` is where a BASIC
  // response's kv_indices start. Empty when it agrees.
  std::string DiffMeta(const v1::Sequence& seq, const SequenceModel& expected, v1::SequenceView view,
                       uint32_t pages_before = 0) const;
  // Tokens [start, start + count) of one layer (a ranged read).
  absl::Status VerifyRange(const std::string& id, const SequenceModel& expected, int layer, uint32_t start,
                           uint32_t count) const;
  // ReadSequence DEQUANTIZED of one layer against DequantizeHost of the
  // model's bytes (the server runs the same function on both backends).
  absl::Status VerifyDequantized(v1::KvCache::Stub& stub, const std::string& id, const SequenceModel& expected,
                                 int layer) const;

 private:
  std::string DiffBytes(int layer, uint32_t first_token, absl::string_view got, absl::string_view want) const;

  KvCacheClient* client_;
  const SoakOptions& options_;
  const PoolGeometry& geometry_;
};

// A violation: the status every check returns when the server broke a
// promise (DATA_LOSS, a code the server never returns, so that context
// added on the way up keeps it recognisable).
absl::Status Mismatch(absl::string_view what);
bool IsMismatch(const absl::Status& status);

}  // namespace mlakv::soak
