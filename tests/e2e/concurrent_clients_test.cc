// 8 clients, each on its own connection, 50 appends of random lengths each
// to their own sequence, all at once; then the allocator and sequence
// invariants, and the stored bytes, are checked.
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_fixture.h"
#include "tests/testing/vector_files.h"

namespace mlakv::e2e {
namespace {

constexpr int kClients = 8;
constexpr int kAppendsPerClient = 50;
constexpr uint32_t kMaxRows = 40;

using ConcurrentClients = E2eTest;

TEST_F(ConcurrentClients, EightClientsFiftyAppendsKeepInvariants) {
  // All rows each client will send, in order; each append takes the next slice.
  std::vector<TestRows> rows(kClients);
  std::vector<std::vector<uint32_t>> lengths(kClients);
  std::mt19937 rng(7);
  for (int c = 0; c < kClients; ++c) {
    uint32_t total = 0;
    for (int i = 0; i < kAppendsPerClient; ++i) {
      lengths[c].push_back(1 + rng() % kMaxRows);
      total += lengths[c].back();
    }
    rows[c] = TestRows::Random(total, 100 + c);
  }

  std::vector<absl::Status> failures(kClients);
  {
    std::vector<std::jthread> threads;
    for (int c = 0; c < kClients; ++c) {
      threads.emplace_back([&, c] {
        std::unique_ptr<KvCacheClient> client = server_->NewClient();
        // Each client's own connection is up before its appends. Under TSan
        // on a loaded two-core machine a first connect to the listening
        // server failed twice in many runs ("UNAVAILABLE: failed to connect
        // ... No such file or directory"), and a fail-fast call fails with
        // it; this test is about the appends, so a failed connect is retried
        // here (a server that does not answer at all still fails the test).
        for (int attempt = 0; attempt < 10 && !client->CheckHealth(absl::Seconds(5)).ok(); ++attempt) {
          client->ConnectNow(absl::Seconds(5));
        }
        uint32_t position = 0;
        for (uint32_t n : lengths[c]) {
          const TestRows slice = rows[c].Slice(position, n);
          // Layers 0 and 1 in one message, as a prefill worker sends them.
          absl::StatusOr<v1::AppendResponse> r =
              client->Append(BothLayersAppend("", absl::StrCat("client-", c), position, slice));
          if (!r.ok()) {
            failures[c] = r.status();
            return;
          }
          position += n;
          if (r->sequence().length() != position) {
            failures[c] =
                absl::InternalError(absl::StrCat("length ", r->sequence().length(), " after append to ", position));
            return;
          }
        }
      });
    }
  }
  for (int c = 0; c < kClients; ++c) ASSERT_TRUE(failures[c].ok()) << "client " << c << ": " << failures[c];

  std::set<uint32_t> pages_seen;
  uint32_t pages_expected = 0;
  for (int c = 0; c < kClients; ++c) {
    SCOPED_TRACE(absl::StrCat("client-", c));
    absl::StatusOr<v1::Sequence> seq = client_->GetSequence("", absl::StrCat("client-", c));
    ASSERT_TRUE(seq.ok()) << seq.status();
    const uint32_t length = rows[c].rows;
    const uint32_t pages = (length + kPageSize - 1) / kPageSize;
    EXPECT_EQ(seq->length(), length);
    EXPECT_EQ(seq->layer_lengths(0), length);
    EXPECT_EQ(seq->layer_lengths(1), length);
    EXPECT_EQ(static_cast<uint32_t>(seq->kv_indices_size()), pages);
    EXPECT_EQ(seq->last_page_len(), length - (pages - 1) * kPageSize);
    for (uint32_t page : seq->kv_indices()) EXPECT_TRUE(pages_seen.insert(page).second) << "page " << page << " twice";
    pages_expected += pages;
    for (uint32_t layer : {0u, 1u}) {
      absl::StatusOr<StoredLayer> stored = client_->ReadLayer("", absl::StrCat("client-", c), layer);
      ASSERT_TRUE(stored.ok()) << stored.status();
      EXPECT_EQ(testing::DescribeMismatch(rows[c].Expected(), AsQuantized(*stored)), "") << "layer " << layer;
    }
  }
  EXPECT_EQ(PagesUsed(), pages_expected);

  absl::StatusOr<std::vector<v1::SequenceSummary>> listed = client_->ListSequences("");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), static_cast<size_t>(kClients));
  for (int c = 0; c < kClients; ++c) {
    EXPECT_EQ((*listed)[c].id(), absl::StrCat("client-", c));  // ordered by id
    EXPECT_EQ((*listed)[c].length(), rows[c].rows);
    EXPECT_EQ((*listed)[c].pages(), (rows[c].rows + kPageSize - 1) / kPageSize);
  }

  for (int c = 0; c < kClients; ++c) ASSERT_TRUE(client_->Free("", absl::StrCat("client-", c)).ok());
  EXPECT_EQ(PagesUsed(), 0u);
}

}  // namespace
}  // namespace mlakv::e2e
