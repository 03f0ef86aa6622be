// Cache management through the gRPC surface, on the device named by
// MLAKV_SERVER_TEST_DEVICE ("cpu" for cache_service_test, "cuda:0" for
// cache_service_cuda_test): a reader's lease outliving a free and the reuse
// of the id, generations on every call that names a sequence, eviction from
// the config, forks read back byte-exact, prefix matches and page leases,
// and every new error with its status and an actionable message.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/server/rpc/service_fixture.h"
#include "tests/testing/vector_files.h"

#ifndef MLAKV_SERVER_TEST_DEVICE
#define MLAKV_SERVER_TEST_DEVICE "cpu"
#endif

namespace mlakv::server::testing {
namespace {

constexpr char kDevice[] = MLAKV_SERVER_TEST_DEVICE;
constexpr float kCkv = 0.25f, kKpe = 0.5f;

class CacheServiceTest : public ::testing::Test, public ServiceFixture {
 protected:
  void SetUp() override {
    if (std::string(kDevice) != "cpu" && !mlakv::testing::HaveCuda()) GTEST_SKIP() << "no CUDA device visible";
    Start("num_layers: 2 page_size: 16 num_pages: 8");
  }
  void TearDown() override { StopServer(); }
  void Start(const std::string& pool) { StartServer(kDevice, absl::StrCat("name: 'default' ", pool)); }

  void MustAppend(const std::string& seq, uint32_t start, const Rows& rows,
                  const std::function<void(v1::AppendRequest&)>& extra = nullptr) {
    v1::AppendRequest m = AppendMessage(seq, start, rows, 0, rows.n, {0, 1}, kCkv, kKpe);
    if (extra) extra(m);
    const grpc::Status s = Append({m});
    ASSERT_TRUE(s.ok()) << Describe(s);
  }

  // The raw stored bytes of [0, count) of every layer, by id or through a lease.
  grpc::Status ReadAll(const std::string& seq, uint64_t lease_id, uint32_t count, std::string* out,
                       std::optional<uint64_t> expect_generation = std::nullopt) {
    grpc::ClientContext ctx;
    v1::ReadSequenceRequest req;
    req.set_sequence(seq);
    req.set_lease_id(lease_id);
    req.set_count(count);
    if (expect_generation) req.set_expect_generation(*expect_generation);
    auto reader = stub().ReadSequence(&ctx, req);
    v1::ReadSequenceResponse r;
    out->clear();
    while (reader->Read(&r)) absl::StrAppend(out, r.layer(), ":", r.ckv_packed(), r.ckv_sf(), r.kpe());
    return reader->Finish();
  }

  template <typename Req, typename Resp, typename Method>
  grpc::Status Call(Method method, const Req& req, Resp* resp) {
    grpc::ClientContext ctx;
    return (stub().*method)(&ctx, req, resp);
  }

  v1::Sequence Get(const std::string& id) {
    v1::Sequence s;
    EXPECT_TRUE(GetSequence(id, &s).ok());
    return s;
  }
};

TEST_F(CacheServiceTest, AReaderWithALeaseKeepsItsBytesWhileTheSequenceIsFreedAndItsIdReused) {
  MustAppend("req", 0, RandomRows(40, 1));
  v1::GetSequenceRequest get;
  get.set_sequence("req");
  get.mutable_lease()->set_holder("decode-7");
  get.mutable_lease()->set_duration_ms(60000);
  v1::Sequence leased;
  ASSERT_TRUE(Call(&v1::KvCache::Stub::GetSequence, get, &leased).ok());
  ASSERT_TRUE(leased.has_lease());
  EXPECT_EQ(leased.lease().tokens(), 40u);
  EXPECT_EQ(leased.lease().holder(), "decode-7");
  EXPECT_EQ(leased.leases(), 1u);
  const uint64_t lease = leased.lease().lease_id();
  std::string before;
  ASSERT_TRUE(ReadAll("", lease, 40, &before).ok());

  v1::FreeSequenceRequest free_req;
  free_req.set_sequence("req");
  v1::FreeSequenceResponse freed;
  ASSERT_TRUE(Call(&v1::KvCache::Stub::FreeSequence, free_req, &freed).ok());
  EXPECT_EQ(freed.leases(), 1u);
  EXPECT_EQ(freed.pages_retained(), 3u);
  EXPECT_EQ(freed.pages_freed(), 0u);
  MustAppend("req", 0, RandomRows(70, 2));  // the id again, on other pages
  const v1::Sequence again = Get("req");
  EXPECT_GT(again.generation(), leased.generation());
  for (uint32_t p : again.kv_indices()) {
    for (uint32_t q : leased.kv_indices()) EXPECT_NE(p, q) << "the leased pages were not handed out";
  }
  std::string after, reused;
  ASSERT_TRUE(ReadAll("", lease, 40, &after).ok());
  EXPECT_EQ(after, before);
  ASSERT_TRUE(ReadAll("req", 0, 40, &reused).ok());
  EXPECT_NE(reused, before);
  EXPECT_EQ(GetPool().sequences_retained(), 1u);
  EXPECT_EQ(GetPool().pages_used(), 8u);

  v1::ReleaseLeaseRequest release;
  release.set_lease_id(lease);
  v1::ReleaseLeaseResponse released;
  ASSERT_TRUE(Call(&v1::KvCache::Stub::ReleaseLease, release, &released).ok());
  EXPECT_EQ(released.pages_freed(), 3u);
  const grpc::Status gone = ReadAll("", lease, 40, &after);
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(gone.error_message(), "expired or was released")) << gone.error_message();
  EXPECT_EQ(GetPool().pages_used(), 5u);
}

TEST_F(CacheServiceTest, EveryCallThatNamesASequenceChecksItsGeneration) {
  MustAppend("s", 0, RandomRows(4, 1));
  const uint64_t gen = Get("s").generation();
  const uint64_t wrong = gen + 1000;
  auto expect_mismatch = [&](const grpc::Status& s, const std::string& what) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << what << ": " << Describe(s);
    EXPECT_TRUE(absl::StrContains(s.error_message(), absl::StrCat(gen)) &&
                absl::StrContains(s.error_message(), absl::StrCat(wrong)))
        << what << ": " << s.error_message();
  };
  {
    v1::GetSequenceRequest r;
    r.set_sequence("s");
    r.set_expect_generation(wrong);
    v1::Sequence out;
    expect_mismatch(Call(&v1::KvCache::Stub::GetSequence, r, &out), "GetSequence");
    r.set_expect_generation(gen);
    EXPECT_TRUE(Call(&v1::KvCache::Stub::GetSequence, r, &out).ok());
  }
  {
    std::string bytes;
    expect_mismatch(ReadAll("s", 0, 4, &bytes, wrong), "ReadSequence");
  }
  {
    v1::TruncateSequenceRequest r;
    r.set_sequence("s");
    r.set_length(1);
    r.set_expect_generation(wrong);
    v1::Sequence out;
    expect_mismatch(Call(&v1::KvCache::Stub::TruncateSequence, r, &out), "TruncateSequence");
  }
  {
    v1::AcquireLeaseRequest r;
    r.set_sequence("s");
    r.set_expect_generation(wrong);
    r.mutable_lease()->set_holder("h");
    v1::Lease out;
    expect_mismatch(Call(&v1::KvCache::Stub::AcquireLease, r, &out), "AcquireLease");
  }
  {
    v1::AppendRequest m = AppendMessage("s", 4, RandomRows(1, 2), 0, 1, {0, 1}, kCkv, kKpe);
    m.set_expect_generation(wrong);
    expect_mismatch(Append({m}), "Append");
  }
  {
    v1::AppendBatchRequest b;
    b.set_dtype(v1::ROW_DTYPE_BFLOAT16);
    v1::SequenceRows* sr = b.add_sequences();
    sr->set_sequence("s");
    sr->set_start(4);
    sr->set_expect_generation(wrong);
    v1::AppendBatchResponse out;
    expect_mismatch(Call(&v1::KvCache::Stub::AppendBatch, b, &out), "AppendBatch");
  }
  {
    v1::FreeSequenceRequest r;
    r.set_sequence("s");
    r.set_expect_generation(wrong);
    v1::FreeSequenceResponse out;
    expect_mismatch(Call(&v1::KvCache::Stub::FreeSequence, r, &out), "FreeSequence");
  }
  EXPECT_EQ(Get("s").length(), 4u) << "nothing changed";
  // Only the first message of a stream may name the generation.
  v1::AppendRequest first = AppendMessage("s", 4, RandomRows(1, 3), 0, 1, {0, 1}, kCkv, kKpe);
  v1::AppendRequest second = AppendMessage("", 5, RandomRows(1, 4), 0, 1, {0, 1}, kCkv, kKpe);
  second.set_expect_generation(gen);
  const grpc::Status s = Append({first, second});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  EXPECT_EQ(Get("s").length(), 4u);
}

TEST_F(CacheServiceTest, AFullPoolWithLruEvictionKeepsAccepting) {
  StopServer();
  Start("num_layers: 2 page_size: 16 num_pages: 8 eviction { policy: 'lru' }");
  for (int i = 0; i < 20; ++i) MustAppend(absl::StrCat("s", i), 0, RandomRows(32, i));  // 2 pages each
  const v1::Pool pool = GetPool();
  EXPECT_EQ(pool.eviction(), v1::EVICTION_POLICY_LRU);
  EXPECT_EQ(pool.sequences(), 4u);
  EXPECT_EQ(pool.evictions(), 16u);
  EXPECT_EQ(pool.evicted_pages(), 32u);
  v1::Sequence s;
  const grpc::Status evicted = GetSequence("s0", &s);
  EXPECT_EQ(evicted.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(evicted.error_message(), "was evicted at")) << evicted.error_message();
  EXPECT_TRUE(GetSequence("s19", &s).ok());
}

TEST_F(CacheServiceTest, ForkedSequencesSharePagesAndReadBackByteExact) {
  MustAppend("src", 0, RandomRows(40, 1));
  v1::ForkSequenceRequest fork;
  fork.set_source("src");
  fork.set_target("dst");
  fork.set_length(40);
  v1::ForkSequenceResponse forked;
  ASSERT_TRUE(Call(&v1::KvCache::Stub::ForkSequence, fork, &forked).ok());
  EXPECT_EQ(forked.pages_shared(), 2u);
  EXPECT_EQ(forked.pages_copied(), 1u);
  EXPECT_EQ(forked.sequence().length(), 40u);
  EXPECT_EQ(forked.sequence().shared_pages(), 2u);
  std::string a, b;
  ASSERT_TRUE(ReadAll("src", 0, 40, &a).ok());
  ASSERT_TRUE(ReadAll("dst", 0, 40, &b).ok());
  EXPECT_EQ(a, b);
  EXPECT_EQ(GetPool().pages_used(), 4u);
  EXPECT_EQ(GetPool().pages_shared(), 2u);
  v1::GetPageRequest page_req;
  page_req.set_page(forked.sequence().kv_indices(0));
  v1::Page page;
  ASSERT_TRUE(Call(&v1::KvCache::Stub::GetPage, page_req, &page).ok());
  EXPECT_EQ(page.references(), 2u);
  // Errors.
  v1::ForkSequenceResponse out;
  grpc::Status s = Call(&v1::KvCache::Stub::ForkSequence, fork, &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << Describe(s);
  fork.set_target("t2");
  fork.set_length(41);
  s = Call(&v1::KvCache::Stub::ForkSequence, fork, &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  fork.clear_source();
  s = Call(&v1::KvCache::Stub::ForkSequence, fork, &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
}

TEST_F(CacheServiceTest, PrefixMatchFindsIndexedPagesAndLeasesThem) {
  MustAppend("a", 0, RandomRows(40, 1), [](v1::AppendRequest& m) {
    m.add_block_hashes("hash-0");
    m.add_block_hashes("hash-1");
    m.add_block_hashes("hash-2");  // page 2 is partial: not indexed yet
  });
  v1::MatchPrefixRequest match;
  for (const char* h : {"hash-0", "hash-1", "hash-2"}) match.add_block_hashes(h);
  match.mutable_lease()->set_holder("router");
  v1::MatchPrefixResponse matched;
  ASSERT_TRUE(Call(&v1::KvCache::Stub::MatchPrefix, match, &matched).ok());
  EXPECT_EQ(matched.matched_pages(), 2u);
  EXPECT_EQ(matched.matched_tokens(), 32u);
  ASSERT_TRUE(matched.has_lease());
  EXPECT_EQ(matched.lease().pages_size(), 2);
  EXPECT_EQ(GetPool().pages_indexed(), 2u);
  v1::GetPageRequest page_req;
  page_req.set_page(matched.kv_indices(0));
  v1::Page page;
  ASSERT_TRUE(Call(&v1::KvCache::Stub::GetPage, page_req, &page).ok());
  EXPECT_TRUE(page.indexed());
  EXPECT_EQ(page.block_hash_hex(), "686173682d30");  // "hash-0"
  EXPECT_EQ(page.references(), 2u);
  // A fork by hash reuses the pages without their rows.
  v1::ForkSequenceRequest fork;
  fork.set_target("b");
  for (const char* h : {"hash-0", "hash-1"}) fork.add_block_hashes(h);
  v1::ForkSequenceResponse forked;
  ASSERT_TRUE(Call(&v1::KvCache::Stub::ForkSequence, fork, &forked).ok());
  EXPECT_EQ(forked.sequence().length(), 32u);
  std::string a, b;
  ASSERT_TRUE(ReadAll("a", 0, 32, &a).ok());
  ASSERT_TRUE(ReadAll("b", 0, 32, &b).ok());
  EXPECT_EQ(a, b);
  // Bad hashes.
  v1::MatchPrefixRequest bad;
  bad.add_block_hashes(std::string(65, 'x'));
  v1::MatchPrefixResponse out;
  grpc::Status s = Call(&v1::KvCache::Stub::MatchPrefix, bad, &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "1..64")) << s.error_message();
}

// A layer's scales change only while nothing is readable under the old
// ones: a freed sequence kept for its reader's lease, or pages a prefix
// match leased (which a fork by hash can take), are outside the layer's
// token count but still read with its scales.
TEST_F(CacheServiceTest, ScalesDoNotChangeWhileALeaseHoldsRowsStoredWithThem) {
  const auto append_other_scales = [&](const std::string& seq) {
    return Append({AppendMessage(seq, 0, RandomRows(16, 9), 0, 16, {0, 1}, 2 * kCkv, 2 * kKpe)});
  };
  const auto release = [&](uint64_t lease) {
    v1::ReleaseLeaseRequest req;
    req.set_lease_id(lease);
    v1::ReleaseLeaseResponse resp;
    ASSERT_TRUE(Call(&v1::KvCache::Stub::ReleaseLease, req, &resp).ok());
  };
  // A reader's lease on a freed sequence.
  MustAppend("read", 0, RandomRows(16, 1));
  v1::GetSequenceRequest get;
  get.set_sequence("read");
  get.mutable_lease()->set_holder("decode");
  v1::Sequence leased;
  ASSERT_TRUE(Call(&v1::KvCache::Stub::GetSequence, get, &leased).ok());
  std::string before, after;
  ASSERT_TRUE(ReadAll("", leased.lease().lease_id(), 16, &before).ok());
  ASSERT_NO_FATAL_FAILURE(Free("read"));
  grpc::Status s = append_other_scales("other");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "1 leases may hold rows stored with them")) << Describe(s);
  ASSERT_TRUE(ReadAll("", leased.lease().lease_id(), 16, &after).ok());
  EXPECT_EQ(after, before);
  ASSERT_NO_FATAL_FAILURE(release(leased.lease().lease_id()));
  ASSERT_TRUE(append_other_scales("other").ok()) << "the layer is empty and no lease is held: scales may change";
  ASSERT_NO_FATAL_FAILURE(Free("other"));
  // A prefix match's page lease, then a fork by hash of those pages.
  MustAppend("a", 0, RandomRows(32, 2), [](v1::AppendRequest& m) {
    m.add_block_hashes("h0");
    m.add_block_hashes("h1");
  });
  ASSERT_TRUE(ReadAll("a", 0, 32, &before).ok());
  v1::MatchPrefixRequest match;
  for (const char* h : {"h0", "h1"}) match.add_block_hashes(h);
  match.mutable_lease()->set_holder("router");
  v1::MatchPrefixResponse matched;
  ASSERT_TRUE(Call(&v1::KvCache::Stub::MatchPrefix, match, &matched).ok());
  ASSERT_EQ(matched.matched_pages(), 2u);
  ASSERT_NO_FATAL_FAILURE(Free("a"));
  s = append_other_scales("b");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
  v1::ForkSequenceRequest fork;
  fork.set_target("c");
  for (const char* h : {"h0", "h1"}) fork.add_block_hashes(h);
  v1::ForkSequenceResponse forked;
  ASSERT_TRUE(Call(&v1::KvCache::Stub::ForkSequence, fork, &forked).ok());
  ASSERT_TRUE(ReadAll("c", 0, 32, &after).ok());
  EXPECT_EQ(after, before);
  v1::ReadSequenceRequest deq;
  deq.set_sequence("c");
  deq.add_layers(0);
  deq.set_format(v1::READ_FORMAT_DEQUANTIZED);
  grpc::ClientContext ctx;
  auto reader = stub().ReadSequence(&ctx, deq);
  v1::ReadSequenceResponse chunk;
  ASSERT_TRUE(reader->Read(&chunk));
  EXPECT_EQ(chunk.ckv_scale(), kCkv) << "the fork reads with the scales its bytes were stored with";
  while (reader->Read(&chunk)) {
  }
  EXPECT_TRUE(reader->Finish().ok());
  ASSERT_NO_FATAL_FAILURE(release(matched.lease().lease_id()));
}

// A ReadSequence stream reads one incarnation: freed and appended again
// while the client reads slowly, the id names another, whose rows must not
// follow the first's in an OK stream.
TEST_F(CacheServiceTest, AReadStreamNeverMixesTwoIncarnations) {
  StopServer();
  Start("num_layers: 2 page_size: 16 num_pages: 512");
  MustAppend("s", 0, RandomRows(2048, 1));
  std::string first;
  ASSERT_TRUE(ReadAll("s", 0, 2048, &first).ok());
  v1::ReadSequenceRequest req;
  req.set_sequence("s");
  req.add_layers(0);
  req.set_tokens_per_message(32);  // 64 messages of ~11 KB: more than the stream's flow-control window
  grpc::ClientContext ctx;
  auto reader = stub().ReadSequence(&ctx, req);
  v1::ReadSequenceResponse chunk;
  ASSERT_TRUE(reader->Read(&chunk));
  ASSERT_NO_FATAL_FAILURE(Free("s"));
  MustAppend("s", 0, RandomRows(2048, 2));
  std::string second;
  ASSERT_TRUE(ReadAll("s", 0, 2048, &second).ok());
  ASSERT_NE(first, second);
  // ReadAll's layout (one message a layer here): "0:", then layer 0's ckv_packed, 256 bytes a token, ...
  const auto of = [](const std::string& all, uint32_t token) { return all.substr(2 + token * 256, 256); };
  int messages = 1, from_second = 0;
  do {
    if (of(second, chunk.start()) == chunk.ckv_packed().substr(0, 256) &&
        of(first, chunk.start()) != chunk.ckv_packed().substr(0, 256)) {
      ++from_second;
    }
  } while (reader->Read(&chunk) && ++messages);
  const grpc::Status end = reader->Finish();
  EXPECT_EQ(from_second, 0) << "rows of the second incarnation in the first's stream";
  // ABORTED once the id names the new incarnation; NOT_FOUND when the
  // server read the next chunk between the free and the new append.
  if (end.error_code() == grpc::StatusCode::ABORTED) {
    EXPECT_TRUE(absl::StrContains(end.error_message(), "freed and created again")) << Describe(end);
  } else {
    EXPECT_EQ(end.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(end) << " after " << messages << " messages";
  }
}

// The views that carry only the pages a call changed (BASIC, COMPACT,
// PACKED) must carry a shared page's private copy too: a decode worker
// keeping its page table from them would go on reading the page it shares
// with the fork's source -- here the source's page, which the append did
// not change and which the pool may free and reuse once the source goes.
TEST_F(CacheServiceTest, TheNewPagesViewsCarryACopiedSharedPage) {
  MustAppend("a", 0, RandomRows(32, 1));  // 2 full pages of 16
  const Rows one = RandomRows(1, 2);
  for (v1::SequenceView view : {v1::SEQUENCE_VIEW_BASIC, v1::SEQUENCE_VIEW_COMPACT, v1::SEQUENCE_VIEW_PACKED}) {
    SCOPED_TRACE(v1::SequenceView_Name(view));
    v1::ForkSequenceRequest fork;
    fork.set_source("a");
    fork.set_target("b");
    v1::ForkSequenceResponse forked;
    ASSERT_TRUE(Call(&v1::KvCache::Stub::ForkSequence, fork, &forked).ok());
    v1::TruncateSequenceRequest cut;
    cut.set_sequence("b");
    cut.set_length(24);  // into the shared second page: the next append there copies it
    v1::Sequence truncated;
    ASSERT_TRUE(Call(&v1::KvCache::Stub::TruncateSequence, cut, &truncated).ok());
    v1::AppendBatchRequest req;
    req.set_view(view);
    *req.add_sequences() = [&] {
      v1::SequenceRows s;
      s.set_sequence("b");
      s.set_start(24);
      s.set_row_count(1);
      for (uint32_t l : {0u, 1u}) {
        v1::LayerRows* rows = s.add_layers();
        rows->set_layer(l);
        rows->set_ckv(one.ckv_bytes(0, 1));
        rows->set_kpe(one.kpe_bytes(0, 1));
      }
      return s;
    }();
    req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
    v1::AppendBatchResponse resp;
    const grpc::Status s = Call(&v1::KvCache::Stub::AppendBatch, req, &resp);
    ASSERT_TRUE(s.ok()) << Describe(s);
    EXPECT_EQ(resp.pages_allocated(), 1u);
    const v1::Sequence now = Get("b");
    ASSERT_EQ(now.kv_indices_size(), 2);
    EXPECT_EQ(now.kv_indices(0), Get("a").kv_indices(0));
    EXPECT_NE(now.kv_indices(1), Get("a").kv_indices(1)) << "the shared page was copied";
    // The response's entries from its offset on, laid over the table the
    // worker had (the truncate's), give the table now.
    std::vector<uint32_t> table(truncated.kv_indices().begin(), truncated.kv_indices().end());
    uint32_t offset;
    std::vector<uint32_t> changed;
    if (view == v1::SEQUENCE_VIEW_PACKED) {
      offset = resp.packed().kv_indices_offsets(0);
      changed.assign(resp.packed().new_pages().begin(), resp.packed().new_pages().end());
      EXPECT_EQ(resp.packed().new_page_counts(0), changed.size());
    } else {
      offset = resp.sequences(0).kv_indices_offset();
      changed.assign(resp.sequences(0).kv_indices().begin(), resp.sequences(0).kv_indices().end());
    }
    table.resize(offset);
    table.insert(table.end(), changed.begin(), changed.end());
    EXPECT_EQ(table, std::vector<uint32_t>(now.kv_indices().begin(), now.kv_indices().end()));
    ASSERT_NO_FATAL_FAILURE(Free("b"));
  }
}

TEST_F(CacheServiceTest, LeaseCallsAndTheirErrors) {
  MustAppend("s", 0, RandomRows(20, 1));
  v1::AcquireLeaseRequest acquire;
  acquire.set_sequence("s");
  v1::Lease lease;
  grpc::Status s = Call(&v1::KvCache::Stub::AcquireLease, acquire, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "holder")) << s.error_message();
  acquire.mutable_lease()->set_holder(std::string(5000, 'h'));
  s = Call(&v1::KvCache::Stub::AcquireLease, acquire, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LT(s.error_message().size(), 1000u) << "bounded quote";
  acquire.mutable_lease()->set_holder("h");
  acquire.mutable_lease()->set_duration_ms(4000u * 1000u);
  s = Call(&v1::KvCache::Stub::AcquireLease, acquire, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  acquire.mutable_lease()->set_duration_ms(0);
  acquire.set_tokens(21);
  s = Call(&v1::KvCache::Stub::AcquireLease, acquire, &lease);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  acquire.set_tokens(10);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Call(&v1::KvCache::Stub::AcquireLease, acquire, &lease).ok());
  EXPECT_EQ(lease.duration_ms(), 30000u) << "the default";
  // A truncate below the lease is refused, naming the protected tokens.
  v1::TruncateSequenceRequest cut;
  cut.set_sequence("s");
  cut.set_length(5);
  v1::Sequence seq;
  s = Call(&v1::KvCache::Stub::TruncateSequence, cut, &seq);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "first 10 tokens")) << s.error_message();
  // Listing, paginated.
  v1::ListLeasesRequest list;
  list.set_page_size(2);
  v1::ListLeasesResponse page1, page2;
  ASSERT_TRUE(Call(&v1::KvCache::Stub::ListLeases, list, &page1).ok());
  EXPECT_EQ(page1.leases_size(), 2);
  EXPECT_EQ(page1.total(), 3u);
  list.set_page_token(page1.next_page_token());
  ASSERT_TRUE(Call(&v1::KvCache::Stub::ListLeases, list, &page2).ok());
  EXPECT_EQ(page2.leases_size(), 1);
  EXPECT_TRUE(page2.next_page_token().empty());
  list.set_page_token("not-a-token");
  s = Call(&v1::KvCache::Stub::ListLeases, list, &page2);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  // Renew and release.
  v1::RenewLeaseRequest renew;
  renew.set_lease_id(lease.lease_id());
  renew.set_duration_ms(5000);
  v1::Lease renewed;
  ASSERT_TRUE(Call(&v1::KvCache::Stub::RenewLease, renew, &renewed).ok());
  EXPECT_EQ(renewed.duration_ms(), 5000u);
  renew.set_lease_id(12345);
  s = Call(&v1::KvCache::Stub::RenewLease, renew, &renewed);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(s);
  v1::ReleaseLeaseRequest release;
  release.set_lease_id(12345);
  v1::ReleaseLeaseResponse released;
  s = Call(&v1::KvCache::Stub::ReleaseLease, release, &released);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(s);
  EXPECT_EQ(GetPool().leases(), 3u);
}

// Threads racing appends, forks, leases, frees and prefix matches on a few
// ids of a small pool with eviction on, while the server's upkeep thread
// expires leases (run under TSan by scripts/sanitize.sh tsan): every call
// ends with a status, the invariants hold, and once everything is released
// no page is left used.
TEST_F(CacheServiceTest, ConcurrentCacheManagementKeepsTheInvariants) {
  StopServer();
  Start("num_layers: 2 page_size: 16 num_pages: 24 eviction { policy: 'lru' } default_lease_seconds: 1");
  const Rows rows = RandomRows(20, 5);
  std::atomic<int> calls{0};
  auto worker = [&](int seed) {
    std::mt19937 gen(seed);
    for (int i = 0; i < 150; ++i) {
      const std::string id = absl::StrCat("s", gen() % 6), other = absl::StrCat("s", gen() % 6);
      grpc::ClientContext ctx;
      switch (gen() % 6) {
        case 0: {
          v1::AppendRequest m = AppendMessage(id, 0, rows, 0, rows.n, {0, 1}, kCkv, kKpe);
          m.add_block_hashes(absl::StrCat("h-", id));
          (void)Append({m});
          break;
        }
        case 1: {
          v1::ForkSequenceRequest r;
          r.set_source(id);
          r.set_target(other);
          r.set_length(1 + gen() % 20);
          v1::ForkSequenceResponse out;
          (void)stub().ForkSequence(&ctx, r, &out);
          break;
        }
        case 2: {
          v1::AcquireLeaseRequest r;
          r.set_sequence(id);
          r.mutable_lease()->set_holder("t");
          r.mutable_lease()->set_duration_ms(1 + gen() % 50);
          v1::Lease out;
          (void)stub().AcquireLease(&ctx, r, &out);
          break;
        }
        case 3: {
          v1::FreeSequenceRequest r;
          r.set_sequence(id);
          v1::FreeSequenceResponse out;
          (void)stub().FreeSequence(&ctx, r, &out);
          break;
        }
        case 4: {
          v1::MatchPrefixRequest r;
          r.add_block_hashes(absl::StrCat("h-", id));
          if (gen() % 2) r.mutable_lease()->set_holder("m"), r.mutable_lease()->set_duration_ms(20);
          v1::MatchPrefixResponse out;
          (void)stub().MatchPrefix(&ctx, r, &out);
          break;
        }
        case 5: {
          std::string bytes;
          (void)ReadAll(id, 0, 0, &bytes);
          break;
        }
      }
      calls.fetch_add(1);
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back(worker, t + 1);
  for (auto& t : threads) t.join();
  EXPECT_EQ(calls.load(), 600);
  const PoolSnapshot::Counters c = pool().Snapshot().counters;
  EXPECT_GT(c.forks, 0u) << "the race reached each operation";
  EXPECT_GT(c.leases_acquired, 0u);
  EXPECT_GT(c.prefix_hit_pages, 0u);
  std::printf("forks %llu, leases %llu (expired %llu), evictions %llu, prefix hits %llu\n",
              static_cast<unsigned long long>(c.forks), static_cast<unsigned long long>(c.leases_acquired),
              static_cast<unsigned long long>(c.leases_expired), static_cast<unsigned long long>(c.evictions),
              static_cast<unsigned long long>(c.prefix_hit_pages));
  absl::Status inv = pool().CheckInvariants();
  ASSERT_TRUE(inv.ok()) << inv;
  // Let every lease end, free what is left: nothing may stay used.
  for (const LeaseSnapshot& l : pool().ListLeases(1000, 0).leases) (void)pool().ReleaseLease(l.id);
  for (const auto& e : pool().ListSequences(1000, "").sequences) ASSERT_TRUE(pool().FreeSequence(e.id).ok());
  EXPECT_EQ(GetPool().pages_used(), 0u);
  EXPECT_EQ(GetPool().sequences_retained(), 0u);
  inv = pool().CheckInvariants();
  EXPECT_TRUE(inv.ok()) << inv;
}

}  // namespace
}  // namespace mlakv::server::testing
