// mlakv pools: every pool's geometry, device and occupancy.
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

namespace mlakv::cli {

int RunPools(const std::vector<std::string>& args) {
  if (!args.empty()) return UsageError("pools [--server ADDR] [--json]", "mlakv pools takes no arguments");
  absl::StatusOr<std::unique_ptr<KvCacheClient>> client = ConnectFromFlags();
  if (!client.ok()) return Fail("pools", client.status());
  absl::StatusOr<std::vector<v1::Pool>> pools = (*client)->ListPools();
  if (!pools.ok()) return Fail("pools", pools.status());

  if (absl::GetFlag(FLAGS_json)) {
    v1::ListPoolsResponse response;
    for (const v1::Pool& pool : *pools) *response.add_pools() = pool;
    std::printf("%s\n", ToJson(response).c_str());
    return kExitOk;
  }
  std::printf("%-12s %-8s %6s %5s %8s %8s %8s %6s %10s %s\n", "POOL", "DEVICE", "LAYERS", "PAGE", "TOTAL", "USED",
              "FREE", "SEQS", "CACHE_MiB", "SCALES_SET");
  for (const v1::Pool& pool : *pools) {
    int scales_set = 0;
    for (const v1::LayerScales& layer : pool.layers()) scales_set += layer.set() ? 1 : 0;
    std::printf("%-12s %-8s %6u %5u %8u %8u %8u %6u %10.1f %d/%u\n", pool.name().c_str(), pool.device().c_str(),
                pool.num_layers(), pool.page_size(), pool.pages_total(), pool.pages_used(), pool.pages_free(),
                pool.sequences(), pool.cache_bytes() / 1048576.0, scales_set, pool.num_layers());
  }
  return kExitOk;
}

}  // namespace mlakv::cli
