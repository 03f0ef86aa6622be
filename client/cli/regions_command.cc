// mlakv regions: the regions registered with the server (--allow_ipc), by name.
#include <cstdio>

#include "absl/flags/flag.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

namespace mlakv::cli {

int RunRegions(const std::vector<std::string>& args) {
  if (!args.empty()) return UsageError("regions [--server ADDR] [--json]", "mlakv regions takes no arguments");
  absl::StatusOr<Connection> client = ConnectFromFlags();
  if (!client.ok()) return Fail("regions", client.status());
  absl::StatusOr<std::vector<v1::Region>> regions = (*client)->ListRegions();
  if (!regions.ok()) return Fail("regions", regions.status());

  if (absl::GetFlag(FLAGS_json)) {
    v1::ListRegionsResponse response;
    for (const v1::Region& region : *regions) *response.add_regions() = region;
    std::printf("%s\n", ToJson(response).c_str());
    return kExitOk;
  }
  if (regions->empty()) {
    std::printf("no regions registered\n");
    return kExitOk;
  }
  std::printf("%-24s %-5s %14s %9s %s\n", "REGION", "KIND", "BYTES", "IN_FLIGHT", "SOURCE");
  for (const v1::Region& region : *regions) {
    std::printf("%-24s %-5s %14llu %9u %s\n", region.name().c_str(),
                region.kind() == v1::REGION_KIND_CUDA ? "cuda" : region.kind() == v1::REGION_KIND_SHM ? "shm" : "?",
                static_cast<unsigned long long>(region.byte_size()), region.appends_in_flight(),
                DescribeRegionSource(region).c_str());
  }
  return kExitOk;
}

}  // namespace mlakv::cli
