// mlakv free ID: release a sequence and all its pages (those a lease holds
// stay until it ends).
#include <cstdio>

#include "absl/flags/flag.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

namespace mlakv::cli {

int RunFree(const std::vector<std::string>& args) {
  if (args.size() != 1) return UsageError("free ID [--expect_generation G] [--pool P] [--server ADDR] [--json]");
  absl::StatusOr<Connection> client = ConnectForSequence(args[0]);
  if (!client.ok()) return Fail("free", client.status());
  absl::StatusOr<v1::FreeSequenceResponse> freed =
      (*client)->FreeSequence(absl::GetFlag(FLAGS_pool), args[0], absl::GetFlag(FLAGS_expect_generation));
  if (!freed.ok()) return Fail("free", freed.status());

  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ToJson(*freed).c_str());
    return kExitOk;
  }
  std::printf("freed sequence %s: %u page(s) returned to the pool\n", args[0].c_str(), freed->pages_freed());
  if (freed->leases() > 0) {
    std::printf("  %u lease(s) still hold it: %u page(s) retained until the last one ends\n", freed->leases(),
                freed->pages_retained());
  }
  return kExitOk;
}

}  // namespace mlakv::cli
