// mlakv truncate ID --length L: roll a sequence back to L tokens in every layer.
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_join.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

namespace mlakv::cli {

int RunTruncate(const std::vector<std::string>& args) {
  constexpr char kUsage[] = "truncate ID --length L [--expect_generation G] [--pool P] [--server ADDR] [--json]";
  const int64_t length = absl::GetFlag(FLAGS_length);
  if (args.size() != 1) return UsageError(kUsage);
  if (length < 0 || length > UINT32_MAX) return UsageError(kUsage, "mlakv truncate: --length L (L >= 0) is required");
  absl::StatusOr<Connection> client = ConnectForSequence(args[0]);
  if (!client.ok()) return Fail("truncate", client.status());
  absl::StatusOr<v1::Sequence> seq =
      (*client)->Truncate(absl::GetFlag(FLAGS_pool), args[0], static_cast<uint32_t>(length),
                          absl::GetFlag(FLAGS_expect_generation));
  if (!seq.ok()) return Fail("truncate", seq.status());

  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ToJson(*seq).c_str());
  } else {
    std::printf("truncated sequence %s to %u tokens; %d page(s) kept: [%s]\n", seq->id().c_str(), seq->length(),
                seq->kv_indices_size(), absl::StrJoin(seq->kv_indices(), ", ").c_str());
  }
  return kExitOk;
}

}  // namespace mlakv::cli
