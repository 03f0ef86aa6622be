// mlakv free ID: release a sequence and all its pages.
#include <cstdio>

#include "absl/flags/flag.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

namespace mlakv::cli {

int RunFree(const std::vector<std::string>& args) {
  if (args.size() != 1) return UsageError("free ID [--pool P] [--server ADDR] [--json]");
  absl::StatusOr<std::unique_ptr<KvCacheClient>> client = ConnectFromFlags();
  if (!client.ok()) return Fail("free", client.status());
  v1::FreeSequenceResponse freed;
  absl::StatusOr<uint32_t> pages = (*client)->Free(absl::GetFlag(FLAGS_pool), args[0]);
  if (!pages.ok()) return Fail("free", pages.status());
  freed.set_pages_freed(*pages);

  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ToJson(freed).c_str());
  } else {
    std::printf("freed sequence %s: %u page(s) returned to the pool\n", args[0].c_str(), *pages);
  }
  return kExitOk;
}

}  // namespace mlakv::cli
