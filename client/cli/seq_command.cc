// mlakv seq ID: one sequence's page table (kv_indices) and per-layer lengths.
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_join.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

namespace mlakv::cli {

int RunSeq(const std::vector<std::string>& args) {
  if (args.size() != 1) return UsageError("seq ID [--pool P] [--server ADDR] [--json]");
  absl::StatusOr<std::unique_ptr<KvCacheClient>> client = ConnectFromFlags();
  if (!client.ok()) return Fail("seq", client.status());
  absl::StatusOr<v1::Sequence> seq = (*client)->GetSequence(absl::GetFlag(FLAGS_pool), args[0]);
  if (!seq.ok()) return Fail("seq", seq.status());

  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ToJson(*seq).c_str());
    return kExitOk;
  }
  std::printf("sequence %s in pool %s\n", seq->id().c_str(), seq->pool().c_str());
  std::printf("  length         %u tokens (every layer)\n", seq->length());
  std::printf("  pages          %d x %u tokens (capacity %u)\n", seq->kv_indices_size(), seq->page_size(),
              seq->capacity_tokens());
  std::printf("  last_page_len  %u\n", seq->last_page_len());
  std::printf("  kv_indices     [%s]\n", absl::StrJoin(seq->kv_indices(), ", ").c_str());
  std::printf("  layer lengths  %s\n",
              DescribeLayerRuns({seq->layer_lengths().begin(), seq->layer_lengths().end()}).c_str());
  return kExitOk;
}

}  // namespace mlakv::cli
