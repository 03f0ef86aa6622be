// mlakv fork SOURCE TARGET: create TARGET sharing the pages of SOURCE's first
// tokens (full pages by reference, a partial last page copied); or, with
// --hashes, from the leading pages of a block-hash chain the pool holds
// (docs/server.md "Shared pages").
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

namespace mlakv::cli {

int RunFork(const std::vector<std::string>& args) {
  constexpr char kUsage[] =
      "fork SOURCE TARGET [--length N] [--pin] [--expect_generation G] [--pool P] [--server ADDR] [--json]\n"
      "       mlakv fork --hashes HEX[,HEX...] TARGET [--pin] [--pool P] [--server ADDR] [--json]";
  const std::string hashes_flag = absl::GetFlag(FLAGS_hashes);
  const int64_t length = absl::GetFlag(FLAGS_length);
  std::vector<std::string> hashes;
  if (hashes_flag.empty()) {
    if (args.size() != 2) return UsageError(kUsage, "mlakv fork: give SOURCE and TARGET");
    if (length < -1 || length > UINT32_MAX) return UsageError(kUsage, "mlakv fork: --length N needs N >= 0");
  } else {
    if (args.size() != 1) return UsageError(kUsage, "mlakv fork --hashes: give TARGET only");
    if (length != -1) return UsageError(kUsage, "mlakv fork --hashes: --length does not apply (whole pages match)");
    if (absl::GetFlag(FLAGS_expect_generation)) {
      return UsageError(kUsage, "mlakv fork --hashes: --expect_generation needs a SOURCE");
    }
    int i = 0;
    for (const std::string& hex : std::vector<std::string>(absl::StrSplit(hashes_flag, ','))) {
      absl::StatusOr<std::string> hash = ParseHashHex(absl::StrCat("--hashes entry ", i++), hex);
      if (!hash.ok()) return UsageError(kUsage, std::string(hash.status().message()));
      hashes.push_back(*std::move(hash));
    }
  }
  // A fork lives on its source's server (it shares its pages).
  absl::StatusOr<Connection> client = hashes.empty() ? ConnectForSequence(args[0]) : ConnectFromFlags();
  if (!client.ok()) return Fail("fork", client.status());
  const std::string pool = absl::GetFlag(FLAGS_pool);
  const std::string& target = hashes.empty() ? args[1] : args[0];
  absl::StatusOr<v1::ForkSequenceResponse> forked =
      hashes.empty() ? (*client)->ForkSequence(pool, args[0], target, length < 0 ? 0 : static_cast<uint32_t>(length),
                                               absl::GetFlag(FLAGS_pin), absl::GetFlag(FLAGS_expect_generation))
                     : (*client)->ForkFromHashes(pool, hashes, target, absl::GetFlag(FLAGS_pin));
  if (!forked.ok()) return Fail("fork", forked.status());

  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ToJson(*forked).c_str());
    return kExitOk;
  }
  if (!forked->has_sequence()) {
    std::printf("no page of the %zu hash(es) is in the pool; %s was not created\n", hashes.size(), target.c_str());
    return kExitOk;
  }
  const v1::Sequence& seq = forked->sequence();
  std::printf("forked %s from %s: %u tokens, %u page(s) shared, %u copied\n", seq.id().c_str(),
              hashes.empty() ? args[0].c_str() : absl::StrCat(hashes.size(), " block hash(es)").c_str(),
              seq.length(), forked->pages_shared(), forked->pages_copied());
  std::printf("  generation     %llu%s\n", static_cast<unsigned long long>(seq.generation()),
              seq.pinned() ? " (pinned)" : "");
  std::printf("  kv_indices     [%s]\n", absl::StrJoin(seq.kv_indices(), ", ").c_str());
  return kExitOk;
}

}  // namespace mlakv::cli
