// mlakv pools: every pool's geometry, device and occupancy, one line each.
// mlakv pool [NAME]: one pool in full (occupancy, sharing, leases, eviction,
// per-layer scales).
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

namespace mlakv::cli {
namespace {

const char* EvictionName(v1::EvictionPolicy policy) {
  switch (policy) {
    case v1::EVICTION_POLICY_NONE:
      return "none";
    case v1::EVICTION_POLICY_LRU:
      return "lru";
    default:
      return "unknown";
  }
}

// One line per pool (with_server: first the server_id that holds it).
int PrintPools(const std::vector<v1::Pool>& all, bool with_server) {
  const std::vector<v1::Pool>* pools = &all;
  if (absl::GetFlag(FLAGS_json)) {
    v1::ListPoolsResponse response;
    for (const v1::Pool& pool : *pools) *response.add_pools() = pool;
    std::printf("%s\n", ToJson(response).c_str());
    return kExitOk;
  }
  if (with_server) std::printf("%-20s ", "SERVER");
  std::printf("%-12s %-8s %6s %5s %8s %8s %8s %6s %10s %7s %6s %8s %7s %5s %-13s %s\n", "POOL", "DEVICE", "LAYERS",
              "PAGE", "TOTAL", "USED", "FREE", "SEQS", "CACHE_MiB", "SHARED", "LEASES", "RETAINED", "INDEXED",
              "EVICT", "EVICTED", "SCALES_SET");
  for (const v1::Pool& pool : *pools) {
    int scales_set = 0;
    for (const v1::LayerScales& layer : pool.layers()) scales_set += layer.set() ? 1 : 0;
    // EVICTED: sequences/pages evicted since the server started.
    const std::string evicted = absl::StrCat(pool.evictions(), "/", pool.evicted_pages());
    if (with_server) std::printf("%-20s ", pool.server_id().c_str());
    std::printf("%-12s %-8s %6u %5u %8u %8u %8u %6u %10.1f %7u %6u %8u %7u %5s %-13s %d/%u\n", pool.name().c_str(),
                pool.device().c_str(), pool.num_layers(), pool.page_size(), pool.pages_total(), pool.pages_used(),
                pool.pages_free(), pool.sequences(), pool.cache_bytes() / 1048576.0, pool.pages_shared(),
                pool.leases(), pool.sequences_retained(), pool.pages_indexed(), EvictionName(pool.eviction()),
                evicted.c_str(), scales_set, pool.num_layers());
  }
  return kExitOk;
}

// Every pool of every server of the fleet, and what failed (printed to
// stderr after the listing; the command then exits 1).
absl::StatusOr<std::vector<v1::Pool>> FleetPools(std::vector<absl::Status>* failures) {
  absl::StatusOr<std::unique_ptr<FleetClient>> fleet = FleetFromFlags();
  if (!fleet.ok()) return fleet.status();
  FleetClient::FromEach<std::vector<v1::Pool>> each = (*fleet)->ListPools();
  std::vector<v1::Pool> pools;
  for (const auto& answer : each.answers) pools.insert(pools.end(), answer.value.begin(), answer.value.end());
  *failures = std::move(each.failures);
  return pools;
}

}  // namespace

int RunPools(const std::vector<std::string>& args) {
  if (!args.empty()) return UsageError("pools [--server ADDR | --servers LIST | --service dns:///NAME:PORT] [--json]",
                                       "mlakv pools takes no arguments");
  // With a fleet: every server's pools, each line naming its server.
  const bool fleet = FleetFlagsGiven();
  std::vector<absl::Status> failures;
  absl::StatusOr<std::vector<v1::Pool>> pools;
  if (fleet) {
    pools = FleetPools(&failures);
  } else {
    absl::StatusOr<Connection> client = ConnectFromFlags();
    if (!client.ok()) return Fail("pools", client.status());
    pools = (*client)->ListPools();
  }
  if (!pools.ok()) return Fail("pools", pools.status());
  const int exit_code = PrintPools(*pools, fleet);
  for (const absl::Status& failure : failures) Fail("pools", failure);
  return failures.empty() ? exit_code : kExitFailed;
}

int RunPool(const std::vector<std::string>& args) {
  constexpr char kUsage[] = "pool [NAME] [--server ADDR] [--json]";
  if (args.size() > 1) return UsageError(kUsage, "mlakv pool takes at most one pool name");
  absl::StatusOr<Connection> client = ConnectFromFlags();
  if (!client.ok()) return Fail("pool", client.status());
  absl::StatusOr<v1::Pool> pool = (*client)->GetPool(args.empty() ? absl::GetFlag(FLAGS_pool) : args[0]);
  if (!pool.ok()) return Fail("pool", pool.status());

  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ToJson(*pool).c_str());
    return kExitOk;
  }
  std::printf("pool %s on %s: %u layer(s), %u tokens per page\n", pool->name().c_str(), pool->device().c_str(),
              pool->num_layers(), pool->page_size());
  std::printf("  pages          %u total, %u used, %u free, %u shared, %u indexed by hash\n", pool->pages_total(),
              pool->pages_used(), pool->pages_free(), pool->pages_shared(), pool->pages_indexed());
  std::printf("  sequences      %u (at most %u), %u freed but retained for leases\n", pool->sequences(),
              pool->max_sequences(), pool->sequences_retained());
  std::printf("  leases         %u\n", pool->leases());
  std::printf("  eviction       %s: %llu sequence(s) evicted, %llu page(s) released\n",
              EvictionName(pool->eviction()), static_cast<unsigned long long>(pool->evictions()),
              static_cast<unsigned long long>(pool->evicted_pages()));
  std::printf("  cache          %.1f MiB (%u bytes per token per layer)\n", pool->cache_bytes() / 1048576.0,
              pool->bytes_per_token_per_layer());
  std::vector<uint32_t> tokens;
  int scales_set = 0;
  for (const v1::LayerScales& layer : pool->layers()) {
    tokens.push_back(static_cast<uint32_t>(layer.tokens()));
    scales_set += layer.set() ? 1 : 0;
  }
  std::printf("  layer tokens   %s\n", DescribeLayerRuns(tokens).c_str());
  std::printf("  scales set     %d of %u layer(s)\n", scales_set, pool->num_layers());
  return kExitOk;
}

}  // namespace mlakv::cli
