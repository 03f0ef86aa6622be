// PoolAuditor: the quiescent checks. With every client parked (no call of
// the soak in flight) the pool must agree with the union of the clients'
// models: pages_free + pages_used == pages_total, pages_used and per-layer
// token counts are the baseline plus the models', the soak's sequences are
// exactly the models' (ListSequences), no page is in two page tables,
// GetPage names the right owner, and a sample of sequences reads back byte
// for byte.
//
// Rollbacks of streams a client ended itself may still be on the server's
// worker when the clients park, so the pool counters get a few seconds to
// converge; a difference that stays is a leak.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "absl/status/statusor.h"
#include "client/kv_cache_client.h"
#include "tests/soak/client_session.h"
#include "tests/soak/soak_options.h"
#include "tests/soak/soak_report.h"

namespace mlakv::soak {

// What the pool held before the soak started (another user's sequences on
// a --server run).
struct PoolBaseline {
  uint32_t pages_used = 0;
  uint32_t sequences = 0;
  std::vector<uint64_t> tokens;  // per layer
};

class PoolAuditor {
 public:
  PoolAuditor(KvCacheClient* client, const SoakOptions& options, const PoolGeometry& geometry, SoakReport* report,
              PoolBaseline baseline);

  // Every client parked. `read_all`: read back every sequence, not a sample.
  void Audit(const std::vector<const ClientSession*>& sessions, bool read_all, std::mt19937_64& rng,
             std::optional<int64_t> rss_kb);
  // After every client freed its sequences: nothing of the soak is left.
  // Returns the pool as it is then, for the report.
  absl::StatusOr<v1::Pool> CheckEmptied();

 private:
  struct Expected {
    uint64_t pages = 0;
    uint32_t sequences = 0;
    std::vector<uint64_t> tokens;
  };
  // Empty when `pool` agrees with the baseline plus `expected`.
  std::string DiffPool(const v1::Pool& pool, const Expected& expected) const;
  // Polls GetPool until it agrees (or the grace passes); reports a lasting difference.
  absl::Duration CheckCounters(const Expected& expected);
  void CheckListing(const std::vector<std::pair<std::string, const SequenceModel*>>& models);
  // ListSequences in small pages (next_page_token) gives the same ids in
  // order as one big page, each once, with the same total.
  void CheckPagination(std::mt19937_64& rng);
  void CheckPageTables(const std::vector<std::pair<std::string, const SequenceModel*>>& models, std::mt19937_64& rng);

  KvCacheClient* client_;
  const SoakOptions& options_;
  const PoolGeometry& geometry_;
  SoakReport* report_;
  PoolBaseline baseline_;
  SequenceVerifier verifier_;
  std::vector<bool> pages_seen_;  // by page id: ever in one of the soak's page tables at an audit
};

}  // namespace mlakv::soak
