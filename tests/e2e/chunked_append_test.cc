// KvCacheClient::Append splits large appends into messages of about
// append_message_bytes inside ONE Append stream: the rows arrive intact, and
// a failure in a later message rolls back the earlier ones too.
#include "gtest/gtest.h"
#include "tests/e2e/e2e_fixture.h"
#include "tests/testing/vector_files.h"

namespace mlakv::e2e {
namespace {

class ChunkedAppend : public E2eTest {
 protected:
  // A client whose messages hold `rows` rows of both layers.
  std::unique_ptr<KvCacheClient> ClientWithMessageRows(uint32_t rows) {
    KvCacheClient::Options options = client_->options();
    options.append_message_bytes = size_t{rows} * 2 * (512 + 64) * 2;
    return std::move(KvCacheClient::Create(options).value());
  }
};

TEST_F(ChunkedAppend, ManyMessagesArriveAsOneAppend) {
  const TestRows rows = TestRows::Random(1000, 21);
  std::unique_ptr<KvCacheClient> client = ClientWithMessageRows(43);  // 24 messages
  absl::StatusOr<v1::AppendResponse> response = client->Append(BothLayersAppend("", "long", 0, rows));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->rows_written(), 2000u);
  EXPECT_EQ(response->pages_allocated(), (1000 + kPageSize - 1) / kPageSize);
  EXPECT_EQ(response->sequence().length(), 1000u);
  for (uint32_t layer : {0u, 1u}) {
    absl::StatusOr<StoredLayer> stored = client_->ReadLayer("", "long", layer);
    ASSERT_TRUE(stored.ok()) << stored.status();
    EXPECT_EQ(testing::DescribeMismatch(rows.Expected(), AsQuantized(*stored)), "") << "layer " << layer;
  }
}

TEST_F(ChunkedAppend, DefaultMessagesCarryAFourMegabytePrefill) {
  const TestRows rows = TestRows::Random(5000, 22);  // 11.5 MB over both layers: 3 messages of < 4 MiB
  absl::StatusOr<v1::AppendResponse> response = client_->Append(BothLayersAppend("", "prefill", 0, rows));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->sequence().length(), 5000u);
  absl::StatusOr<StoredLayer> stored = client_->ReadLayer("", "prefill", 1);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(testing::DescribeMismatch(rows.Expected(), AsQuantized(*stored)), "");
}

TEST_F(ChunkedAppend, FailureInALaterMessageRollsBackTheEarlierOnes) {
  // "tiny" holds 64 tokens; messages of 20 rows: the fourth one runs out.
  const TestRows rows = TestRows::Random(100, 23);
  std::unique_ptr<KvCacheClient> client = ClientWithMessageRows(20);
  absl::StatusOr<v1::AppendResponse> response = client->Append(BothLayersAppend(kTinyPool, "too-long", 0, rows));
  EXPECT_EQ(response.status().code(), absl::StatusCode::kResourceExhausted) << response.status();
  EXPECT_EQ(PagesUsed(kTinyPool), 0u);
  EXPECT_EQ(client_->GetSequence(kTinyPool, "too-long").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ChunkedAppend, RefusesWrongByteCountsBeforeSending) {
  TestRows rows = TestRows::Random(4, 24);
  AppendRows append = BothLayersAppend("", "bad", 0, rows);
  append.rows = 5;
  absl::StatusOr<v1::AppendResponse> response = client_->Append(append);
  EXPECT_EQ(response.status().code(), absl::StatusCode::kInvalidArgument) << response.status();
  EXPECT_EQ(client_->GetSequence("", "bad").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace mlakv::e2e
