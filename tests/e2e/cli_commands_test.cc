// The query and housekeeping commands of `mlakv` against a real server: text
// for people, JSON for scripts, the server's status code name on failure
// (exit 1), usage mistakes exit 2.
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/e2e_fixture.h"

namespace mlakv::e2e {
namespace {

class CliCommands : public E2eTest {
 protected:
  void SetUp() override {
    E2eTest::SetUp();
    if (HasFatalFailure() || IsSkipped()) return;
    rows_ = TestRows::Random(40, 11);  // 3 pages
    ASSERT_TRUE(client_->Append(BothLayersAppend("", "seq-a", 0, rows_)).ok());
  }
  nlohmann::json Json(const std::vector<std::string>& args) {
    std::vector<std::string> with_json = args;
    with_json.push_back("--json");
    const CommandResult r = server_->RunCli(with_json);
    EXPECT_EQ(r.exit_code, 0) << r.Describe();
    return nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  }
  TestRows rows_;
};

TEST_F(CliCommands, PoolsListsBothPools) {
  const CommandResult text = server_->RunCli({"pools"});
  ASSERT_EQ(text.exit_code, 0) << text.Describe();
  EXPECT_NE(text.out.find("default"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find(kTinyPool), std::string::npos) << text.out;

  const nlohmann::json j = Json({"pools"});
  ASSERT_EQ(j["pools"].size(), 2u) << j.dump();
  const nlohmann::json& pool = j["pools"][0];
  EXPECT_EQ(pool["name"], "default");
  EXPECT_EQ(pool["device"], SuiteDevice());
  EXPECT_EQ(pool["num_layers"], kLayers);
  EXPECT_EQ(pool["page_size"], kPageSize);
  EXPECT_EQ(pool["pages_total"], kPages);
  EXPECT_EQ(pool["pages_used"], 3);
  EXPECT_EQ(pool["pages_free"], kPages - 3);
}

TEST_F(CliCommands, SeqsSeqAndPageDescribeTheSequence) {
  const nlohmann::json seqs = Json({"seqs"});
  ASSERT_EQ(seqs["sequences"].size(), 1u) << seqs.dump();
  EXPECT_EQ(seqs["sequences"][0]["id"], "seq-a");
  EXPECT_EQ(seqs["sequences"][0]["length"], 40);
  EXPECT_EQ(seqs["sequences"][0]["pages"], 3);

  const nlohmann::json seq = Json({"seq", "seq-a"});
  EXPECT_EQ(seq["length"], 40);
  EXPECT_EQ(seq["last_page_len"], 8);
  ASSERT_EQ(seq["kv_indices"].size(), 3u);
  EXPECT_EQ(seq["layer_lengths"][0], 40);
  EXPECT_EQ(seq["layer_lengths"][1], 40);
  const CommandResult text = server_->RunCli({"seq", "seq-a"});
  ASSERT_EQ(text.exit_code, 0) << text.Describe();
  EXPECT_NE(text.out.find("layers 0-1: 40"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("kv_indices"), std::string::npos) << text.out;

  const uint32_t last_page = seq["kv_indices"][2].get<uint32_t>();
  const nlohmann::json page = Json({"page", std::to_string(last_page)});
  EXPECT_EQ(page["used"], true);
  EXPECT_EQ(page["sequence"], "seq-a");
  EXPECT_EQ(page["page_index"], 2);
  EXPECT_EQ(page["first_position"], 2 * kPageSize);
  EXPECT_EQ(page["filled_per_layer"][0], 8);
  EXPECT_EQ(page["filled_per_layer"][1], 8);
  EXPECT_EQ(page["layers_written"], nlohmann::json::array({0, 1}));
}

TEST_F(CliCommands, TruncateAndFree) {
  const nlohmann::json truncated = Json({"truncate", "seq-a", "--length", "17"});
  EXPECT_EQ(truncated["length"], 17);
  EXPECT_EQ(truncated["kv_indices"].size(), 2u);
  EXPECT_EQ(PagesUsed(), 2u);
  const CommandResult freed = server_->RunCli({"free", "seq-a"});
  ASSERT_EQ(freed.exit_code, 0) << freed.Describe();
  EXPECT_NE(freed.out.find("2 page(s)"), std::string::npos) << freed.out;
  EXPECT_EQ(PagesUsed(), 0u);
}

TEST_F(CliCommands, ServerErrorsPrintTheCodeAndExitOne) {
  const CommandResult missing = server_->RunCli({"seq", "no-such-sequence"});
  EXPECT_EQ(missing.exit_code, 1) << missing.Describe();
  EXPECT_NE(missing.err.find("NOT_FOUND"), std::string::npos) << missing.Describe();
  const CommandResult bad_pool = server_->RunCli({"seqs", "--pool", "no-such-pool"});
  EXPECT_EQ(bad_pool.exit_code, 1) << bad_pool.Describe();
  EXPECT_NE(bad_pool.err.find("NOT_FOUND"), std::string::npos) << bad_pool.Describe();
  const CommandResult unreachable =
      RunCommand({CliBinary(), "pools", "--server", "127.0.0.1:1", "--timeout_s", "5"}, absl::Seconds(30));
  EXPECT_EQ(unreachable.exit_code, 1) << unreachable.Describe();
  EXPECT_NE(unreachable.err.find("UNAVAILABLE"), std::string::npos) << unreachable.Describe();
}

TEST_F(CliCommands, UsageMistakesExitTwo) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"seq"}, {"page", "x"}, {"truncate", "seq-a"}, {"append", "--sequence", "s"}, {"export", "--layer", "0"},
           {"bench", "--duration_s", "0"}, {"no-such-command"}}) {
    const CommandResult r = server_->RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << args[0] << ": " << r.Describe();
  }
}

}  // namespace
}  // namespace mlakv::e2e
