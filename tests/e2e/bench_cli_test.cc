// `mlakv bench`, bounded by request count, against a real server: it must
// finish with zero errors, report what it sent, and free what it created.
#include <map>
#include <string>

#include "absl/strings/ascii.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/e2e_fixture.h"

namespace mlakv::e2e {
namespace {

using BenchCli = E2eTest;

nlohmann::json RunBench(ServerUnderTest& server, std::vector<std::string> args) {
  args.insert(args.begin(), "bench");
  args.push_back("--json");
  const CommandResult r = server.RunCli(args, absl::Seconds(120));
  EXPECT_EQ(r.exit_code, 0) << r.Describe();
  return nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
}

TEST_F(BenchCli, AppendMixRunsCleanAndFreesItsSequences) {
  const nlohmann::json j = RunBench(*server_, {"--concurrency", "2", "--requests", "20", "--rows_per_message", "100",
                                               "--layers", "2", "--batch_fraction", "0.5", "--duration_s", "0"});
  EXPECT_EQ(j["requests"], 20) << j.dump();
  EXPECT_EQ(j["errors"], 0) << j.dump();
  EXPECT_EQ(j["rows"], 20 * 100 * 2) << j.dump();
  EXPECT_EQ(j["row_bytes"], 20 * 100 * 2 * 1152) << j.dump();
  EXPECT_GT(j["latency_us"]["p50"].get<double>(), 0) << j.dump();
  EXPECT_LE(j["latency_us"]["p99"].get<double>(), j["latency_us"]["max"].get<double>()) << j.dump();
  EXPECT_EQ(j["sequences_freed"], 2) << j.dump();
  EXPECT_EQ(PagesUsed(), 0u);
  EXPECT_TRUE(client_->ListSequences("")->empty());
}

TEST_F(BenchCli, WorkersShareOneConnection) {
  const nlohmann::json j = RunBench(*server_, {"--concurrency", "3", "--connections", "1", "--requests", "30",
                                               "--rows_per_message", "64", "--duration_s", "0"});
  EXPECT_EQ(j["concurrency"], 3) << j.dump();
  EXPECT_EQ(j["connections"], 1) << j.dump();
  EXPECT_EQ(j["requests"], 30) << j.dump();
  EXPECT_EQ(j["errors"], 0) << j.dump();
  EXPECT_EQ(j["rows"], 30 * 64) << j.dump();
  EXPECT_EQ(j["sequences_freed"], 3) << "every worker's sequence, over the shared connection: " << j.dump();
  EXPECT_EQ(PagesUsed(), 0u);
}

TEST_F(BenchCli, MoreConnectionsThanWorkersIsRefused) {
  const CommandResult r = server_->RunCli({"bench", "--concurrency", "2", "--connections", "3", "--requests", "1",
                                           "--duration_s", "0"},
                                          absl::Seconds(30));
  EXPECT_NE(r.exit_code, 0) << r.Describe();
  EXPECT_NE(r.err.find("connections must be in [0, concurrency = 2]"), std::string::npos) << r.Describe();
}

TEST_F(BenchCli, DecodeStepRunsCleanAndFreesItsSequences) {
  const nlohmann::json j = RunBench(*server_, {"--mode", "decode", "--sequences", "64", "--layers", "2",
                                               "--requests", "40", "--duration_s", "30", "--dtype", "f16"});
  EXPECT_EQ(j["requests"], 40) << j.dump();
  EXPECT_EQ(j["errors"], 0) << j.dump();
  EXPECT_EQ(j["rows"], 40 * 64 * 2) << j.dump();
  EXPECT_EQ(j["sequences_freed"], 64) << j.dump();
  EXPECT_EQ(PagesUsed(), 0u);
}

// --view reaches the requests: the same steps' responses shrink from the full
// view (whole page tables, per-layer lengths) to basic (no lengths, only new
// pages) to compact (basic without the names) to lengths (compact without the
// page ids of the steps that allocate a page).
TEST_F(BenchCli, DecodeStepViewShrinksTheResponses) {
  std::map<std::string, int64_t> bytes;
  for (const std::string view : {"full", "basic", "compact", "lengths", "packed"}) {
    const nlohmann::json j = RunBench(*server_, {"--mode", "decode", "--sequences", "16", "--layers", "2",
                                                 "--requests", "10", "--duration_s", "0", "--view", view});
    EXPECT_EQ(j["errors"], 0) << j.dump();
    EXPECT_EQ(j["view"], "SEQUENCE_VIEW_" + absl::AsciiStrToUpper(view)) << j.dump();
    bytes[view] = j["response_bytes_per_request"].get<int64_t>();
  }
  EXPECT_GT(bytes["full"], bytes["basic"]);
  EXPECT_GT(bytes["basic"], bytes["compact"]);
  EXPECT_GT(bytes["compact"], bytes["lengths"]);
  EXPECT_GT(bytes["lengths"], 0);
  EXPECT_GT(bytes["compact"], bytes["packed"]);  // one message of arrays instead of 16 Sequence messages
  EXPECT_GT(bytes["packed"], 0);
  EXPECT_EQ(PagesUsed(), 0u);

  const CommandResult bad = server_->RunCli({"bench", "--view", "tiny\n", "--requests", "1"}, absl::Seconds(30));
  EXPECT_NE(bad.exit_code, 0) << bad.Describe();
  EXPECT_NE(bad.err.find("--view 'tiny\\n' is not full, basic, compact, lengths or packed"), std::string::npos)
      << bad.Describe();
  // PACKED answers AppendBatch only: the append mode's streams refuse it, so the CLI does first.
  const CommandResult stream = server_->RunCli({"bench", "--view", "packed", "--requests", "1"}, absl::Seconds(30));
  EXPECT_NE(stream.exit_code, 0) << stream.Describe();
  EXPECT_NE(stream.err.find("--view packed answers an AppendBatch (--mode decode)"), std::string::npos)
      << stream.Describe();
}

TEST_F(BenchCli, RecyclesSequencesWhenThePoolShareIsFull) {
  // "tiny" gives one worker 3 of its 4 pages (48 tokens): every third request
  // of 16 rows starts a fresh sequence after freeing the full one.
  const nlohmann::json j = RunBench(*server_, {"--pool", kTinyPool, "--rows_per_message", "16", "--layers", "2",
                                               "--requests", "10", "--batch_fraction", "0.5"});
  EXPECT_EQ(j["requests"], 10) << j.dump();
  EXPECT_EQ(j["errors"], 0) << j.dump();
  EXPECT_EQ(j["context_tokens"], 48) << j.dump();
  EXPECT_EQ(j["cleanup_error"], "") << j.dump();
  EXPECT_EQ(PagesUsed(kTinyPool), 0u);
}

TEST_F(BenchCli, DurationBoundStopsTheRun) {
  const nlohmann::json j = RunBench(*server_, {"--duration_s", "1", "--rows_per_message", "16"});
  EXPECT_EQ(j["errors"], 0) << j.dump();
  EXPECT_GT(j["requests"].get<int>(), 0) << j.dump();
  EXPECT_LT(j["seconds"].get<double>(), 10) << j.dump();
  EXPECT_EQ(PagesUsed(), 0u);
}

}  // namespace
}  // namespace mlakv::e2e
