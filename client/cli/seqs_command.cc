// mlakv seqs: the sequences of a pool, with length and pages held.
#include <cstdio>

#include "absl/flags/flag.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

namespace mlakv::cli {

namespace {

// With a fleet: every server's sequences, with the server that holds each.
int RunFleetSeqs(const std::string& pool) {
  absl::StatusOr<std::unique_ptr<FleetClient>> fleet = FleetFromFlags();
  if (!fleet.ok()) return Fail("seqs", fleet.status());
  FleetClient::FromEach<std::vector<v1::SequenceSummary>> each = (*fleet)->ListSequences(pool);
  size_t total = 0;
  if (absl::GetFlag(FLAGS_json)) {
    // One ListSequencesResponse per server, one per line.
    for (const auto& answer : each.answers) {
      v1::ListSequencesResponse response;
      for (const v1::SequenceSummary& s : answer.value) *response.add_sequences() = s;
      response.set_total(static_cast<uint32_t>(answer.value.size()));
      response.set_server_id(answer.server_id);
      std::printf("%s\n", ToJson(response).c_str());
    }
  } else {
    std::printf("%-20s %-40s %8s %6s\n", "SERVER", "SEQUENCE", "LENGTH", "PAGES");
    for (const auto& answer : each.answers) {
      for (const v1::SequenceSummary& s : answer.value) {
        std::printf("%-20s %-40s %8u %6u\n", answer.server_id.c_str(), s.id().c_str(), s.length(), s.pages());
      }
      total += answer.value.size();
    }
    std::printf("%zu sequence(s) in pool %s on %zu server(s)\n", total, pool.empty() ? "(default)" : pool.c_str(),
                each.answers.size());
  }
  for (const absl::Status& failure : each.failures) Fail("seqs", failure);
  return each.failures.empty() ? kExitOk : kExitFailed;
}

}  // namespace

int RunSeqs(const std::vector<std::string>& args) {
  if (!args.empty()) return UsageError("seqs [--pool P] [--server ADDR] [--json]", "mlakv seqs takes no arguments");
  if (FleetFlagsGiven()) return RunFleetSeqs(absl::GetFlag(FLAGS_pool));
  absl::StatusOr<Connection> client = ConnectFromFlags();
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
