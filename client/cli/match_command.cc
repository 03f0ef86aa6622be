// mlakv match HASH_HEX...: how many leading pages of a block-hash chain the
// pool holds, and which; --lease_holder also takes a page lease on them, so
// that they stay until a fork uses them (docs/server.md "Shared pages").
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

namespace mlakv::cli {

int RunMatch(const std::vector<std::string>& args) {
  constexpr char kUsage[] =
      "match HASH_HEX... [--lease_holder H [--duration_ms N]] [--pool P] [--server ADDR] [--json]";
  if (args.empty()) return UsageError(kUsage, "mlakv match: give the chain's block hashes, first page first");
  std::vector<std::string> hashes;
  for (size_t i = 0; i < args.size(); ++i) {
    absl::StatusOr<std::string> hash = ParseHashHex(absl::StrCat("hash ", i), args[i]);
    if (!hash.ok()) return UsageError(kUsage, absl::StrCat("mlakv match: ", hash.status().message()));
    hashes.push_back(*std::move(hash));
  }
  std::optional<LeaseTerms> lease;
  if (const std::string holder = absl::GetFlag(FLAGS_lease_holder); !holder.empty()) {
    lease = LeaseTerms{.holder = holder, .duration = absl::Milliseconds(absl::GetFlag(FLAGS_duration_ms))};
  }
  absl::StatusOr<Connection> client = ConnectFromFlags();
  if (!client.ok()) return Fail("match", client.status());
  absl::StatusOr<v1::MatchPrefixResponse> match = (*client)->MatchPrefix(absl::GetFlag(FLAGS_pool), hashes, lease);
  if (!match.ok()) return Fail("match", match.status());

  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ToJson(*match).c_str());
    return kExitOk;
  }
  std::printf("matched %u of %zu page(s) (%u tokens): kv_indices [%s]\n", match->matched_pages(), hashes.size(),
              match->matched_tokens(), absl::StrJoin(match->kv_indices(), ", ").c_str());
  if (match->has_lease()) {
    std::printf("  %s\n", DescribeLease(match->lease()).c_str());
  } else if (lease) {
    std::printf("  no lease taken: nothing matched\n");
  }
  return kExitOk;
}

}  // namespace mlakv::cli
