// mlakv page N: who owns a page and how full it is in each layer.
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_join.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

namespace mlakv::cli {

int RunPage(const std::vector<std::string>& args) {
  constexpr char kUsage[] = "page N [--pool P] [--server ADDR] [--json]";
  uint32_t page_id = 0;
  if (args.size() != 1) return UsageError(kUsage);
  if (!ParseUint32(args[0], &page_id)) return UsageError(kUsage, "mlakv page: N must be a page id (0, 1, ...)");
  absl::StatusOr<Connection> client = ConnectFromFlags();
  if (!client.ok()) return Fail("page", client.status());
  absl::StatusOr<v1::Page> page = (*client)->GetPage(absl::GetFlag(FLAGS_pool), page_id);
  if (!page.ok()) return Fail("page", page.status());

  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ToJson(*page).c_str());
    return kExitOk;
  }
  if (!page->used()) {
    std::printf("page %u: free\n", page->page());
    return kExitOk;
  }
  std::printf("page %u: owned by sequence %s (page %u of its table, positions from %u)\n", page->page(),
              page->sequence().c_str(), page->page_index(), page->first_position());
  std::printf("  filled entries  %s\n",
              DescribeLayerRuns({page->filled_per_layer().begin(), page->filled_per_layer().end()}).c_str());
  std::printf("  layers written  [%s]\n", absl::StrJoin(page->layers_written(), ", ").c_str());
  std::printf("  references      %u%s\n", page->references(), page->references() > 1 ? " (shared)" : "");
  if (page->indexed()) std::printf("  block hash      %s\n", page->block_hash_hex().c_str());
  if (page->sequence_freed()) std::printf("  owner freed     kept only for a lease\n");
  return kExitOk;
}

}  // namespace mlakv::cli
