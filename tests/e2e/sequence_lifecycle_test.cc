// What happens to pages and lengths around the edges: a client cancelling
// mid-stream, a full pool, truncate and free, a 64-sequence AppendBatch.
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_fixture.h"
#include "tests/testing/vector_files.h"

namespace mlakv::e2e {
namespace {

using SequenceLifecycle = E2eTest;

// Polls until the pool's used pages equal `want` (the server finishes a
// cancelled call asynchronously); returns the last value seen.
uint32_t WaitForPagesUsed(KvCacheClient& client, uint32_t want) {
  uint32_t used = 0;
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<v1::Pool> pool = client.GetPool("");
    if (pool.ok()) used = pool->pages_used();
    if (used == want) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return used;
}

TEST_F(SequenceLifecycle, CancelledAppendLeavesNoPagesBehind) {
  const TestRows kept = TestRows::Random(20, 1);
  ASSERT_TRUE(client_->Append(BothLayersAppend("", "kept", 0, kept)).ok());
  const uint32_t used_before = PagesUsed();
  ASSERT_EQ(used_before, 2u);

  // Two streams, cancelled after several messages: one extends "kept", one
  // creates "cancelled". Each message: 200 rows (13 pages' worth in total).
  const TestRows chunk = TestRows::Random(200, 2);
  for (const auto& [sequence, start] : {std::pair<std::string, uint32_t>{"kept", 20}, {"cancelled", 0}}) {
    grpc::ClientContext context;
    v1::AppendResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> writer = client_->stub().Append(&context, &response);
    for (uint32_t m = 0; m < 3; ++m) {
      v1::AppendRequest message;
      message.set_sequence(sequence);
      message.set_start(start + m * chunk.rows);
      message.set_row_count(chunk.rows);
      message.set_dtype(v1::ROW_DTYPE_BFLOAT16);
      v1::LayerRows* layer = message.add_layers();
      layer->set_layer(0);
      layer->set_ckv(chunk.ckv);
      layer->set_kpe(chunk.kpe);
      layer->set_ckv_scale(kCkvScale);
      layer->set_kpe_scale(kKpeScale);
      ASSERT_TRUE(writer->Write(message));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let the server take them in
    context.TryCancel();
    const grpc::Status status = writer->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
  }

  EXPECT_EQ(WaitForPagesUsed(*client_, used_before), used_before);
  EXPECT_EQ(PagesUsed(), used_before);
  absl::StatusOr<v1::Sequence> seq = client_->GetSequence("", "kept");
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(seq->length(), 20u);
  EXPECT_EQ(seq->kv_indices_size(), 2);
  EXPECT_EQ(client_->GetSequence("", "cancelled").status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<StoredLayer> stored = client_->ReadLayer("", "kept", 0);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(testing::DescribeMismatch(kept.Expected(), AsQuantized(*stored)), "");
}

TEST_F(SequenceLifecycle, PoolExhaustionIsResourceExhaustedAndWritesNothing) {
  // "tiny": 4 pages of 16 tokens.
  const TestRows first = TestRows::Random(40, 3);  // 3 pages
  ASSERT_TRUE(client_->Append(BothLayersAppend(kTinyPool, "a", 0, first)).ok());
  ASSERT_EQ(PagesUsed(kTinyPool), 3u);

  const TestRows more = TestRows::Random(40, 4);
  absl::StatusOr<v1::AppendResponse> b = client_->Append(BothLayersAppend(kTinyPool, "b", 0, more));
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted) << b.status();
  absl::StatusOr<v1::AppendResponse> a = client_->Append(BothLayersAppend(kTinyPool, "a", 40, more));
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted) << a.status();

  EXPECT_EQ(PagesUsed(kTinyPool), 3u);
  EXPECT_EQ(client_->GetSequence(kTinyPool, "b").status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<v1::Sequence> seq = client_->GetSequence(kTinyPool, "a");
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(seq->length(), 40u);
  EXPECT_EQ(seq->kv_indices_size(), 3);
  absl::StatusOr<StoredLayer> stored = client_->ReadLayer(kTinyPool, "a", 0);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(testing::DescribeMismatch(first.Expected(), AsQuantized(*stored)), "");

  // The CLI reports it with the code's name and exit status 1.
  const std::string file = testing::VectorsDir() + "/" + testing::VectorFileNames().at(0);
  const CommandResult cli = server_->RunCli({"append", "--pool", kTinyPool, "--sequence", "c", "--layer", "1",
                                             "--input", file, "--start", "0",
                                             "--ckv_scale", absl::StrFormat("%.9g", kCkvScale),
                                             "--kpe_scale", absl::StrFormat("%.9g", kKpeScale)});
  if (testing::LoadVectorCase(testing::VectorFileNames().at(0)).rows > kPageSize) {
    EXPECT_EQ(cli.exit_code, 1) << cli.Describe();
    EXPECT_NE(cli.err.find("RESOURCE_EXHAUSTED"), std::string::npos) << cli.Describe();
    EXPECT_EQ(PagesUsed(kTinyPool), 3u);
  }
}

TEST_F(SequenceLifecycle, TruncateThenFreeReleasesPages) {
  const TestRows rows = TestRows::Random(100, 5);  // 7 pages
  ASSERT_TRUE(client_->Append(BothLayersAppend("", "t", 0, rows)).ok());
  ASSERT_EQ(PagesUsed(), 7u);

  absl::StatusOr<v1::Sequence> seq = client_->Truncate("", "t", 33);
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(seq->length(), 33u);
  EXPECT_EQ(seq->kv_indices_size(), 3);
  EXPECT_EQ(seq->last_page_len(), 1u);
  EXPECT_EQ(seq->layer_lengths(0), 33u);
  EXPECT_EQ(seq->layer_lengths(1), 33u);
  EXPECT_EQ(PagesUsed(), 3u);
  absl::StatusOr<StoredLayer> stored = client_->ReadLayer("", "t", 1);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(testing::DescribeMismatch(rows.Slice(0, 33).Expected(), AsQuantized(*stored)), "");

  EXPECT_FALSE(client_->Truncate("", "t", 34).ok()) << "truncate past the longest layer must fail";
  EXPECT_EQ(client_->Truncate("", "nope", 0).status().code(), absl::StatusCode::kNotFound);

  // Appending after a truncate continues from the new length.
  const TestRows tail = TestRows::Random(5, 6);
  ASSERT_TRUE(client_->Append(OneLayerAppend("", "t", 0, 33, tail)).ok());
  EXPECT_EQ(client_->GetSequence("", "t")->layer_lengths(0), 38u);

  absl::StatusOr<uint32_t> freed = client_->Free("", "t");
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 3u);
  EXPECT_EQ(PagesUsed(), 0u);
  EXPECT_EQ(client_->GetSequence("", "t").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Free("", "t").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SequenceLifecycle, AppendBatchWritesSixtyFourSequencesInOneCall) {
  constexpr int kSequences = 64;
  constexpr uint32_t kTokens = 3;
  // Half the sequences exist already with 10 tokens; the batch extends those
  // and creates the others.
  const TestRows prefix = TestRows::Random(10, 7);
  for (int s = 0; s < kSequences; s += 2) {
    ASSERT_TRUE(client_->Append(BothLayersAppend("", absl::StrCat("b", s), 0, prefix)).ok());
  }
  std::vector<TestRows> step;
  v1::AppendBatchRequest request;
  request.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  for (int s = 0; s < kSequences; ++s) step.push_back(TestRows::Random(kTokens, 1000 + s));
  for (int s = 0; s < kSequences; ++s) {
    v1::SequenceRows* seq = request.add_sequences();
    seq->set_sequence(absl::StrCat("b", s));
    seq->set_start(s % 2 == 0 ? 10 : 0);
    seq->set_row_count(kTokens);
    for (uint32_t layer : {0u, 1u}) {
      v1::LayerRows* l = seq->add_layers();
      l->set_layer(layer);
      l->set_ckv(step[s].ckv);
      l->set_kpe(step[s].kpe);
      l->set_ckv_scale(kCkvScale);
      l->set_kpe_scale(kKpeScale);
    }
  }
  absl::StatusOr<v1::AppendBatchResponse> response = client_->AppendBatch(request);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->rows_written(), uint64_t{kSequences} * kTokens * 2);
  ASSERT_EQ(response->sequences_size(), kSequences);
  for (int s = 0; s < kSequences; ++s) {
    SCOPED_TRACE(absl::StrCat("b", s));
    const v1::Sequence& seq = response->sequences(s);
    EXPECT_EQ(seq.id(), absl::StrCat("b", s));
    EXPECT_EQ(seq.length(), s % 2 == 0 ? 13u : 3u);
    EXPECT_EQ(seq.kv_indices_size(), 1);
    EXPECT_EQ(seq.SerializeAsString(), client_->GetSequence("", seq.id())->SerializeAsString());
  }
  EXPECT_EQ(PagesUsed(), uint32_t{kSequences});
  for (int s : {0, 1, 62, 63}) {
    absl::StatusOr<StoredLayer> stored = client_->ReadLayer("", absl::StrCat("b", s), 1);
    ASSERT_TRUE(stored.ok()) << stored.status();
    QuantizedRows want = step[s].Expected();
    if (s % 2 == 0) {
      QuantizedRows head = prefix.Expected();
      head.rows += want.rows;
      head.ckv_packed.insert(head.ckv_packed.end(), want.ckv_packed.begin(), want.ckv_packed.end());
      head.ckv_sf.insert(head.ckv_sf.end(), want.ckv_sf.begin(), want.ckv_sf.end());
      head.kpe.insert(head.kpe.end(), want.kpe.begin(), want.kpe.end());
      want = head;
    }
    EXPECT_EQ(testing::DescribeMismatch(want, AsQuantized(*stored)), "") << "b" << s;
  }
}

}  // namespace
}  // namespace mlakv::e2e
