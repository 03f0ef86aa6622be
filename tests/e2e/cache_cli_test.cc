// The cache-management commands of `mlakv` against a real server: leases
// (acquire, renew, release, list), forks (from a sequence, from a block-hash
// chain), prefix matches, and what seq / free / page / pool / pools show of
// generations, leases, pins, shared and indexed pages, retained sequences and
// eviction counters. Text for people, JSON for scripts, the server's status
// code name on failure (exit 1), usage mistakes exit 2.
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/e2e_fixture.h"
#include "tests/testing/vector_files.h"

namespace mlakv::e2e {
namespace {

// Three distinct 8-byte block hashes of a chain (the server treats them as opaque).
const std::vector<std::string>& Hashes() {
  static const auto* hashes = new std::vector<std::string>{
      absl::HexStringToBytes("a0a1a2a3a4a5a6a7"), absl::HexStringToBytes("b0b1b2b3b4b5b6b7"),
      absl::HexStringToBytes("c0c1c2c3c4c5c6c7")};
  return *hashes;
}

class CliCacheCommands : public E2eTest {
 protected:
  void SetUp() override {
    E2eTest::SetUp();
    if (HasFatalFailure() || IsSkipped()) return;
    rows_ = TestRows::Random(40, 23);  // 3 pages: 16 + 16 + 8
    absl::StatusOr<v1::AppendResponse> r = client_->Append(BothLayersAppend("", "seq-a", 0, rows_));
    ASSERT_TRUE(r.ok()) << r.status();
    generation_ = r->sequence().generation();
    ASSERT_GT(generation_, 0u);
  }
  CommandResult Text(const std::vector<std::string>& args) {
    const CommandResult r = server_->RunCli(args);
    EXPECT_EQ(r.exit_code, 0) << r.Describe();
    return r;
  }
  nlohmann::json Json(const std::vector<std::string>& args) {
    std::vector<std::string> with_json = args;
    with_json.push_back("--json");
    const CommandResult r = server_->RunCli(with_json);
    EXPECT_EQ(r.exit_code, 0) << r.Describe();
    return nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  }
  static bool Has(const CommandResult& r, const std::string& text) { return r.out.find(text) != std::string::npos; }

  TestRows rows_;
  uint64_t generation_ = 0;
};

// proto3 JSON writes 64-bit integers as strings.
uint64_t U64(const nlohmann::json& value) {
  return value.is_string() ? std::stoull(value.get<std::string>()) : value.get<uint64_t>();
}

TEST_F(CliCacheCommands, SeqShowsGenerationLeasesPinAndSharedPages) {
  const nlohmann::json seq = Json({"seq", "seq-a"});
  EXPECT_EQ(U64(seq["generation"]), generation_);
  EXPECT_EQ(seq["leases"], 0);
  EXPECT_EQ(seq["pinned"], false);
  EXPECT_EQ(seq["shared_pages"], 0);
  const CommandResult text = Text({"seq", "seq-a"});
  EXPECT_TRUE(Has(text, absl::StrCat("generation     ", generation_))) << text.out;
  EXPECT_TRUE(Has(text, "leases         0")) << text.out;
  EXPECT_TRUE(Has(text, "pinned         no")) << text.out;
  EXPECT_TRUE(Has(text, "3 x 16 tokens (capacity 48), 0 shared")) << text.out;

  // --expect_generation: the right one answers, another is FAILED_PRECONDITION.
  EXPECT_EQ(Json({"seq", "seq-a", "--expect_generation", absl::StrCat(generation_)})["length"], 40);
  const CommandResult stale = server_->RunCli({"seq", "seq-a", "--expect_generation", absl::StrCat(generation_ + 1)});
  EXPECT_EQ(stale.exit_code, 1) << stale.Describe();
  EXPECT_NE(stale.err.find("FAILED_PRECONDITION"), std::string::npos) << stale.Describe();

  // --lease_holder takes a lease with the answer.
  const nlohmann::json leased = Json({"seq", "seq-a", "--lease_holder", "reader", "--duration_ms", "15000"});
  EXPECT_EQ(leased["lease"]["holder"], "reader");
  EXPECT_EQ(leased["lease"]["tokens"], 40);
  EXPECT_EQ(leased["lease"]["duration_ms"], 15000);
  EXPECT_EQ(leased["leases"], 1);
  const CommandResult leased_text = Text({"seq", "seq-a", "--lease_holder", "reader-2"});
  EXPECT_TRUE(Has(leased_text, "leases         2")) << leased_text.out;
  EXPECT_TRUE(Has(leased_text, "took lease ")) << leased_text.out;
  EXPECT_TRUE(Has(leased_text, "holder reader-2")) << leased_text.out;
}

TEST_F(CliCacheCommands, LeaseAcquireListRenewReleaseAroundAFree) {
  const nlohmann::json lease =
      Json({"lease", "acquire", "seq-a", "--holder", "cli-worker", "--duration_ms", "20000", "--tokens", "16"});
  const uint64_t id = U64(lease["lease_id"]);
  ASSERT_GT(id, 0u) << lease.dump();
  EXPECT_EQ(lease["sequence"], "seq-a");
  EXPECT_EQ(U64(lease["generation"]), generation_);
  EXPECT_EQ(lease["holder"], "cli-worker");
  EXPECT_EQ(lease["tokens"], 16);
  EXPECT_EQ(lease["duration_ms"], 20000);
  const std::string id_text = absl::StrCat(id);

  const CommandResult acquired = Text({"lease", "acquire", "seq-a", "--holder", "second", "--tokens", "8"});
  EXPECT_TRUE(Has(acquired, "acquired lease ")) << acquired.out;
  EXPECT_TRUE(Has(acquired, absl::StrCat("on sequence seq-a (generation ", generation_, "): tokens [0, 8)")))
      << acquired.out;
  EXPECT_TRUE(Has(acquired, "holder second")) << acquired.out;

  const nlohmann::json listed = Json({"lease", "list"});
  ASSERT_EQ(listed["leases"].size(), 2u) << listed.dump();
  EXPECT_EQ(U64(listed["leases"][0]["lease_id"]), id);
  EXPECT_EQ(listed["leases"][1]["holder"], "second");
  EXPECT_EQ(listed["total"], 2);
  const CommandResult list_text = Text({"lease", "list"});
  EXPECT_TRUE(Has(list_text, "cli-worker")) << list_text.out;
  EXPECT_TRUE(Has(list_text, "2 lease(s)")) << list_text.out;
  EXPECT_TRUE(Has(Text({"seq", "seq-a"}), "leases         2"));

  const nlohmann::json renewed = Json({"lease", "renew", id_text, "--duration_ms", "30000"});
  EXPECT_EQ(U64(renewed["lease_id"]), id);
  EXPECT_EQ(renewed["duration_ms"], 30000);
  EXPECT_TRUE(Has(Text({"lease", "renew", id_text}), absl::StrCat("renewed lease ", id_text)));

  // A free keeps what the leases protect (tokens [0, 16): one page) until the last one ends.
  const CommandResult freed = Text({"free", "seq-a"});
  EXPECT_TRUE(Has(freed, "2 page(s) returned to the pool")) << freed.out;
  EXPECT_TRUE(Has(freed, "2 lease(s) still hold it: 1 page(s) retained")) << freed.out;
  const nlohmann::json pool = Json({"pool"});
  EXPECT_EQ(pool["sequences"], 0);
  EXPECT_EQ(pool["sequences_retained"], 1);
  EXPECT_EQ(pool["leases"], 2);
  EXPECT_EQ(pool["pages_used"], 1);
  const CommandResult pool_text = Text({"pool"});
  EXPECT_TRUE(Has(pool_text, "0 (at most")) << pool_text.out;
  EXPECT_TRUE(Has(pool_text, "1 freed but retained for leases")) << pool_text.out;
  EXPECT_TRUE(Has(pool_text, "leases         2")) << pool_text.out;
  EXPECT_TRUE(Has(Text({"lease", "list"}), "sequence-freed"));

  const nlohmann::json second = Json({"lease", "list"})["leases"][1];
  const nlohmann::json released_first = Json({"lease", "release", id_text});
  EXPECT_EQ(released_first["pages_freed"], 0);  // the second lease still holds the page
  const CommandResult released = Text({"lease", "release", absl::StrCat(U64(second["lease_id"]))});
  EXPECT_TRUE(Has(released, "1 page(s) returned to the pool")) << released.out;
  EXPECT_EQ(PagesUsed(), 0u);
  EXPECT_TRUE(Has(Text({"lease", "list"}), "0 lease(s)"));

  // An ended lease is NOT_FOUND.
  for (const char* verb : {"renew", "release"}) {
    const CommandResult gone = server_->RunCli({"lease", verb, id_text});
    EXPECT_EQ(gone.exit_code, 1) << gone.Describe();
    EXPECT_NE(gone.err.find("NOT_FOUND"), std::string::npos) << gone.Describe();
  }
}

TEST_F(CliCacheCommands, ForkSharesPagesAndPoolsShowThem) {
  const nlohmann::json fork = Json({"fork", "seq-a", "seq-b"});
  EXPECT_EQ(fork["pages_shared"], 2);
  EXPECT_EQ(fork["pages_copied"], 1);
  EXPECT_EQ(fork["sequence"]["id"], "seq-b");
  EXPECT_EQ(fork["sequence"]["length"], 40);
  const CommandResult pinned = Text({"fork", "seq-a", "seq-c", "--length", "16", "--pin"});
  EXPECT_TRUE(Has(pinned, "forked seq-c from seq-a: 16 tokens, 1 page(s) shared, 0 copied")) << pinned.out;
  EXPECT_TRUE(Has(pinned, "(pinned)")) << pinned.out;

  const nlohmann::json b = Json({"seq", "seq-b"});
  EXPECT_EQ(b["shared_pages"], 2);
  EXPECT_NE(U64(b["generation"]), generation_);
  EXPECT_EQ(Json({"seq", "seq-c"})["pinned"], true);
  EXPECT_TRUE(Has(Text({"seq", "seq-c"}), "pinned         yes"));
  EXPECT_TRUE(Has(Text({"seq", "seq-a"}), "3 x 16 tokens (capacity 48), 2 shared"));
  const nlohmann::json a = Json({"seq", "seq-a"});
  const CommandResult page = Text({"page", absl::StrCat(a["kv_indices"][0].get<uint32_t>())});
  EXPECT_TRUE(Has(page, "references      3 (shared)")) << page.out;  // seq-a, seq-b, seq-c

  // The stored bytes of the fork are the source's.
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    absl::StatusOr<StoredLayer> src = client_->ReadLayer("", "seq-a", layer);
    absl::StatusOr<StoredLayer> dst = client_->ReadLayer("", "seq-b", layer);
    ASSERT_TRUE(src.ok() && dst.ok());
    EXPECT_EQ(src->ckv_packed, dst->ckv_packed);
    EXPECT_EQ(src->kpe, dst->kpe);
  }

  // pool / pools show the sharing: page 0 is held by three tables, page 1 by two.
  EXPECT_EQ(Json({"pool"})["pages_shared"], 2);
  EXPECT_EQ(Json({"pools"})["pools"][0]["pages_shared"], 2);
  const CommandResult pools = Text({"pools"});
  for (const char* column : {"SHARED", "LEASES", "RETAINED", "INDEXED", "EVICT", "EVICTED"}) {
    EXPECT_TRUE(Has(pools, column)) << column << "\n" << pools.out;
  }
  EXPECT_TRUE(Has(pools, " none ")) << pools.out;
  EXPECT_TRUE(Has(Text({"pool"}), "pages          1024 total, 4 used, 1020 free, 2 shared, 0 indexed by hash"));

  // Errors: an existing target, a fork onto itself, too many tokens, a stale generation.
  const std::vector<std::pair<std::vector<std::string>, std::string>> failures = {
      {{"fork", "seq-a", "seq-b"}, "ALREADY_EXISTS"},
      {{"fork", "seq-a", "seq-a"}, "INVALID_ARGUMENT"},
      {{"fork", "seq-a", "seq-d", "--length", "41"}, "OUT_OF_RANGE"},
      {{"fork", "seq-a", "seq-d", "--expect_generation", absl::StrCat(generation_ + 1)}, "FAILED_PRECONDITION"},
      {{"fork", "no-such", "seq-d"}, "NOT_FOUND"}};
  for (const auto& [args, code] : failures) {
    const CommandResult r = server_->RunCli(args);
    EXPECT_EQ(r.exit_code, 1) << args[2] << ": " << r.Describe();
    EXPECT_NE(r.err.find(code), std::string::npos) << code << ": " << r.Describe();
  }
}

TEST_F(CliCacheCommands, MatchAndForkByBlockHash) {
  AppendRows append = BothLayersAppend("", "hashed", 0, rows_);
  append.block_hashes = Hashes();
  absl::StatusOr<v1::AppendResponse> r = client_->Append(append);
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::Sequence& seq = r->sequence();
  const std::string h0 = absl::BytesToHexString(Hashes()[0]), h1 = absl::BytesToHexString(Hashes()[1]),
                    h2 = absl::BytesToHexString(Hashes()[2]);

  // Two complete pages are indexed; the third (8 of 16 tokens) is not.
  const CommandResult match = Text({"match", h0, h1, "0x" + h2});
  EXPECT_TRUE(Has(match, absl::StrCat("matched 2 of 3 page(s) (32 tokens): kv_indices [", seq.kv_indices(0), ", ",
                                      seq.kv_indices(1), "]")))
      << match.out;
  const nlohmann::json j = Json({"match", h0, h1, h2});
  EXPECT_EQ(j["matched_pages"], 2);
  EXPECT_EQ(j["matched_tokens"], 32);
  EXPECT_EQ(Json({"match", "ff", h0, h1})["matched_pages"], 0);  // matching stops at the first unknown hash
  EXPECT_EQ(Json({"pool"})["pages_indexed"], 2);
  const CommandResult page = Text({"page", absl::StrCat(seq.kv_indices(1))});
  EXPECT_TRUE(Has(page, "block hash      " + h1)) << page.out;

  // --lease_holder: a page lease on the matched pages.
  const nlohmann::json leased = Json({"match", h0, h1, "--lease_holder", "prefetch", "--duration_ms", "10000"});
  EXPECT_EQ(leased["lease"]["holder"], "prefetch");
  EXPECT_EQ(leased["lease"]["pages"], nlohmann::json::array({seq.kv_indices(0), seq.kv_indices(1)}));
  EXPECT_EQ(leased["lease"]["sequence"], "");
  const CommandResult list = Text({"lease", "list"});
  EXPECT_TRUE(Has(list, "(pages)")) << list.out;
  EXPECT_TRUE(Has(list, "prefetch")) << list.out;
  const CommandResult leased_text = Text({"match", h0, "--lease_holder", "one"});
  EXPECT_TRUE(Has(leased_text, absl::StrCat("on 1 page(s) [", seq.kv_indices(0), "]"))) << leased_text.out;
  const CommandResult unmatched = Text({"match", "ff", "--lease_holder", "nobody"});
  EXPECT_TRUE(Has(unmatched, "matched 0 of 1 page(s)")) << unmatched.out;
  EXPECT_TRUE(Has(unmatched, "no lease taken")) << unmatched.out;

  // fork --hashes: the target takes the matched pages.
  const nlohmann::json fork = Json({"fork", "--hashes", h0 + "," + h1 + "," + h2, "from-hash"});
  EXPECT_EQ(fork["pages_shared"], 2);
  EXPECT_EQ(fork["pages_copied"], 0);
  EXPECT_EQ(fork["sequence"]["length"], 32);
  EXPECT_EQ(fork["sequence"]["kv_indices"], nlohmann::json::array({seq.kv_indices(0), seq.kv_indices(1)}));
  const CommandResult none = Text({"fork", "--hashes", "0102", "never"});
  EXPECT_TRUE(Has(none, "never was not created")) << none.out;
  const CommandResult missing = server_->RunCli({"seq", "never"});
  EXPECT_EQ(missing.exit_code, 1) << missing.Describe();

  // The server's check of a hash's size (1..64 bytes).
  const CommandResult too_long = server_->RunCli({"match", std::string(130, 'a')});
  EXPECT_EQ(too_long.exit_code, 1) << too_long.Describe();
  EXPECT_NE(too_long.err.find("INVALID_ARGUMENT"), std::string::npos) << too_long.Describe();
}

TEST_F(CliCacheCommands, UsageMistakesExitTwo) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"fork"},
           {"fork", "seq-a"},
           {"fork", "seq-a", "b", "c"},
           {"fork", "--hashes", "00", "a", "b"},
           {"fork", "--hashes", "0g", "a"},
           {"fork", "--hashes", "00,", "a"},
           {"fork", "--hashes", "00", "--length", "3", "a"},
           {"lease"},
           {"lease", "bogus"},
           {"lease", "acquire", "seq-a"},
           {"lease", "acquire", "--holder", "h"},
           {"lease", "renew"},
           {"lease", "renew", "x"},
           {"lease", "release", "1x"},
           {"lease", "list", "extra"},
           {"match"},
           {"match", "abc"},
           {"match", "zz"},
           {"pool", "a", "b"}}) {
    const CommandResult r = server_->RunCli(args);
    EXPECT_EQ(r.exit_code, 2) << absl::StrJoin(args, " ") << ": " << r.Describe();
    EXPECT_NE(r.err.find("usage: mlakv"), std::string::npos) << r.Describe();
  }
}

// A server whose "lru" pool evicts: the counters in pool / pools.
class CliEvictionCommands : public E2eTest {
 protected:
  void SetUp() override {
    if (SuiteDevice() != "cpu" && !testing::HaveCuda()) GTEST_SKIP() << "no CUDA device visible";
    ServerUnderTest::Options options;
    options.device = SuiteDevice();
    options.config_text = TestPoolsConfig() +
                          "pools { name: \"lru\" num_layers: 2 page_size: 16 num_pages: 4 "
                          "eviction { policy: \"lru\" } }\n";
    absl::StatusOr<std::unique_ptr<ServerUnderTest>> server = ServerUnderTest::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    client_ = server_->NewClient();
  }
};

TEST_F(CliEvictionCommands, PoolAndPoolsShowEvictions) {
  const TestRows rows = TestRows::Random(40, 5);  // 3 of the 4 pages
  ASSERT_TRUE(client_->Append(BothLayersAppend("lru", "old", 0, rows)).ok());
  ASSERT_TRUE(client_->Append(BothLayersAppend("lru", "new", 0, rows)).ok());  // evicts "old"

  const CommandResult json = server_->RunCli({"pool", "lru", "--json"});
  ASSERT_EQ(json.exit_code, 0) << json.Describe();
  const nlohmann::json pool = nlohmann::json::parse(json.out, nullptr, false);
  EXPECT_EQ(pool["eviction"], "EVICTION_POLICY_LRU");
  EXPECT_EQ(U64(pool["evictions"]), 1u);
  EXPECT_EQ(U64(pool["evicted_pages"]), 3u);
  const CommandResult text = server_->RunCli({"pool", "--pool", "lru"});
  ASSERT_EQ(text.exit_code, 0) << text.Describe();
  EXPECT_NE(text.out.find("eviction       lru: 1 sequence(s) evicted, 3 page(s) released"), std::string::npos)
      << text.out;
  const CommandResult pools = server_->RunCli({"pools"});
  ASSERT_EQ(pools.exit_code, 0) << pools.Describe();
  EXPECT_NE(pools.out.find("  lru 1/3 "), std::string::npos) << pools.out;
}

}  // namespace
}  // namespace mlakv::e2e
