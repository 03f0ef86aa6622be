// mlakv seqs: the sequences of a pool, with length and pages held.
#include <cstdio>

#include "absl/flags/flag.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

namespace mlakv::cli {

int RunSeqs(const std::vector<std::string>& args) {
  if (!args.empty()) return UsageError("seqs [--pool P] [--server ADDR] [--json]", "mlakv seqs takes no arguments");
  absl::StatusOr<std::unique_ptr<KvCacheClient>> client = ConnectFromFlags();
  if (!client.ok()) return Fail("seqs", client.status());
  const std::string pool = absl::GetFlag(FLAGS_pool);
  absl::StatusOr<std::vector<v1::SequenceSummary>> sequences = (*client)->ListSequences(pool);
  if (!sequences.ok()) return Fail("seqs", sequences.status());

  if (absl::GetFlag(FLAGS_json)) {
    v1::ListSequencesResponse response;  // every page joined into one listing
    for (const v1::SequenceSummary& s : *sequences) *response.add_sequences() = s;
    response.set_total(static_cast<uint32_t>(sequences->size()));
    std::printf("%s\n", ToJson(response).c_str());
    return kExitOk;
  }
  std::printf("%-40s %8s %6s\n", "SEQUENCE", "LENGTH", "PAGES");
  for (const v1::SequenceSummary& s : *sequences) {
    std::printf("%-40s %8u %6u\n", s.id().c_str(), s.length(), s.pages());
  }
  std::printf("%zu sequence(s) in pool %s\n", sequences->size(), pool.empty() ? "(default)" : pool.c_str());
  return kExitOk;
}

}  // namespace mlakv::cli
