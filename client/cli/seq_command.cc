// mlakv seq ID: one sequence's page table (kv_indices), per-layer lengths,
// generation, leases, pin and shared pages; --lease_holder also takes a lease.
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_join.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

namespace mlakv::cli {

int RunSeq(const std::vector<std::string>& args) {
  if (args.size() != 1) {
    return UsageError(
        "seq ID [--expect_generation G] [--lease_holder H [--duration_ms N]] [--pool P] [--server ADDR] [--json]");
  }
  absl::StatusOr<Connection> client = ConnectForSequence(args[0]);
  if (!client.ok()) return Fail("seq", client.status());
  GetSequenceOptions options{.expect_generation = absl::GetFlag(FLAGS_expect_generation)};
  if (const std::string holder = absl::GetFlag(FLAGS_lease_holder); !holder.empty()) {
    options.lease = LeaseTerms{.holder = holder, .duration = absl::Milliseconds(absl::GetFlag(FLAGS_duration_ms))};
  }
  absl::StatusOr<v1::Sequence> seq = (*client)->GetSequence(absl::GetFlag(FLAGS_pool), args[0], options);
  if (!seq.ok()) return Fail("seq", seq.status());

  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ToJson(*seq).c_str());
    return kExitOk;
  }
  std::printf("sequence %s in pool %s\n", seq->id().c_str(), seq->pool().c_str());
  std::printf("  generation     %llu\n", static_cast<unsigned long long>(seq->generation()));
  std::printf("  length         %u tokens (every layer)\n", seq->length());
  std::printf("  pages          %d x %u tokens (capacity %u), %u shared\n", seq->kv_indices_size(), seq->page_size(),
              seq->capacity_tokens(), seq->shared_pages());
  std::printf("  last_page_len  %u\n", seq->last_page_len());
  std::printf("  kv_indices     [%s]\n", absl::StrJoin(seq->kv_indices(), ", ").c_str());
  std::printf("  layer lengths  %s\n",
              DescribeLayerRuns({seq->layer_lengths().begin(), seq->layer_lengths().end()}).c_str());
  std::printf("  leases         %u\n", seq->leases());
  std::printf("  pinned         %s\n", seq->pinned() ? "yes" : "no");
  if (seq->has_lease()) std::printf("  took %s\n", DescribeLease(seq->lease()).c_str());
  return kExitOk;
}

}  // namespace mlakv::cli
