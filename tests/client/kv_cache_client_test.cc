// KvCacheClient against a scripted KvCache service on loopback: what the
// client puts on the wire (how an append is split into messages, which fields
// only the first message carries, region references advancing with the
// rows, the deadline of every call), what it checks before sending anything,
// and how it turns what comes back into values and statuses. The real
// server's side of the same calls: tests/server/rpc/service_test.cc.
#include "client/kv_cache_client.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <map>
#include <memory>
#include <thread>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace mlakv {
namespace {

constexpr size_t kCkvRowBytes = 512 * 2;
constexpr size_t kKpeRowBytes = 64 * 2;

// Records what arrives; answers what the test scripted.
class ScriptedKvCache final : public v1::KvCache::Service {
 public:
  grpc::Status Append(grpc::ServerContext* ctx, grpc::ServerReader<v1::AppendRequest>* reader,
                      v1::AppendResponse* response) override {
    RecordDeadline(ctx);
    v1::AppendRequest message;
    std::vector<v1::AppendRequest> got;
    while (reader->Read(&message)) got.push_back(message);
    absl::MutexLock lock(&mu_);
    ++calls_;
    appends_ = std::move(got);
    response->mutable_sequence()->set_id(appends_.empty() ? "" : appends_[0].sequence());
    return status_;
  }

  grpc::Status ReadSequence(grpc::ServerContext* ctx, const v1::ReadSequenceRequest* request,
                            grpc::ServerWriter<v1::ReadSequenceResponse>* writer) override {
    RecordDeadline(ctx);
    absl::MutexLock lock(&mu_);
    ++calls_;
    read_request_ = *request;
    for (const v1::ReadSequenceResponse& chunk : chunks_) writer->Write(chunk);
    return status_;
  }

  grpc::Status GetPool(grpc::ServerContext* ctx, const v1::GetPoolRequest*, v1::Pool* pool) override {
    RecordDeadline(ctx);
    absl::MutexLock lock(&mu_);
    ++calls_;
    *pool = pool_;
    return grpc::Status::OK;
  }

  grpc::Status ListSequences(grpc::ServerContext* ctx, const v1::ListSequencesRequest* request,
                             v1::ListSequencesResponse* response) override {
    RecordDeadline(ctx);
    absl::MutexLock lock(&mu_);
    ++calls_;
    list_tokens_.push_back(request->page_token());
    const size_t page = list_tokens_.size() - 1;
    if (page < list_pages_.size()) *response = list_pages_[page];
    return status_;
  }

  grpc::Status FreeSequence(grpc::ServerContext* ctx, const v1::FreeSequenceRequest* request,
                            v1::FreeSequenceResponse* response) override {
    Record(ctx, "FreeSequence", *request);
    absl::MutexLock lock(&mu_);
    response->set_pages_freed(3);
    response->set_leases(2);
    response->set_pages_retained(5);
    return status_;
  }

  // ---- cache management: each records its request and answers what was scripted ----
  grpc::Status GetSequence(grpc::ServerContext* ctx, const v1::GetSequenceRequest* request,
                           v1::Sequence* response) override {
    Record(ctx, "GetSequence", *request);
    absl::MutexLock lock(&mu_);
    *response = sequence_;
    return status_;
  }
  grpc::Status TruncateSequence(grpc::ServerContext* ctx, const v1::TruncateSequenceRequest* request,
                                v1::Sequence* response) override {
    Record(ctx, "TruncateSequence", *request);
    absl::MutexLock lock(&mu_);
    *response = sequence_;
    return status_;
  }
  grpc::Status AcquireLease(grpc::ServerContext* ctx, const v1::AcquireLeaseRequest* request,
                            v1::Lease* response) override {
    Record(ctx, "AcquireLease", *request);
    absl::MutexLock lock(&mu_);
    *response = lease_;
    return status_;
  }
  grpc::Status RenewLease(grpc::ServerContext* ctx, const v1::RenewLeaseRequest* request,
                          v1::Lease* response) override {
    Record(ctx, "RenewLease", *request);
    absl::MutexLock lock(&mu_);
    *response = lease_;
    return status_;
  }
  grpc::Status ReleaseLease(grpc::ServerContext* ctx, const v1::ReleaseLeaseRequest* request,
                            v1::ReleaseLeaseResponse* response) override {
    Record(ctx, "ReleaseLease", *request);
    absl::MutexLock lock(&mu_);
    response->set_pages_freed(4);
    return status_;
  }
  grpc::Status ListLeases(grpc::ServerContext* ctx, const v1::ListLeasesRequest* request,
                          v1::ListLeasesResponse* response) override {
    Record(ctx, "ListLeases", *request);
    absl::MutexLock lock(&mu_);
    const size_t page = requests_["ListLeases"].size() - 1;
    if (page < lease_pages_.size()) *response = lease_pages_[page];
    return status_;
  }
  grpc::Status ForkSequence(grpc::ServerContext* ctx, const v1::ForkSequenceRequest* request,
                            v1::ForkSequenceResponse* response) override {
    Record(ctx, "ForkSequence", *request);
    absl::MutexLock lock(&mu_);
    *response = fork_;
    return status_;
  }
  grpc::Status AppendBatch(grpc::ServerContext* ctx, const v1::AppendBatchRequest* request,
                           v1::AppendBatchResponse* response) override {
    Record(ctx, "AppendBatch", *request);
    absl::MutexLock lock(&mu_);
    response->set_rows_written(static_cast<uint64_t>(request->sequences_size()) * 7);
    return status_;
  }
  grpc::Status MatchPrefix(grpc::ServerContext* ctx, const v1::MatchPrefixRequest* request,
                           v1::MatchPrefixResponse* response) override {
    Record(ctx, "MatchPrefix", *request);
    absl::MutexLock lock(&mu_);
    *response = match_;
    return status_;
  }

  // ---- scripting and inspection ----
  void Answer(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    status_ = std::move(status);
  }
  void Chunks(std::vector<v1::ReadSequenceResponse> chunks) {
    absl::MutexLock lock(&mu_);
    chunks_ = std::move(chunks);
  }
  void PoolInfo(v1::Pool pool) {
    absl::MutexLock lock(&mu_);
    pool_ = std::move(pool);
  }
  void ListPages(std::vector<v1::ListSequencesResponse> pages) {
    absl::MutexLock lock(&mu_);
    list_pages_ = std::move(pages);
    list_tokens_.clear();
  }
  void SequenceAnswer(v1::Sequence sequence) {
    absl::MutexLock lock(&mu_);
    sequence_ = std::move(sequence);
  }
  void LeaseAnswer(v1::Lease lease) {
    absl::MutexLock lock(&mu_);
    lease_ = std::move(lease);
  }
  void LeasePages(std::vector<v1::ListLeasesResponse> pages) {
    absl::MutexLock lock(&mu_);
    lease_pages_ = std::move(pages);
    requests_.erase("ListLeases");
  }
  void ForkAnswer(v1::ForkSequenceResponse fork) {
    absl::MutexLock lock(&mu_);
    fork_ = std::move(fork);
  }
  void MatchAnswer(v1::MatchPrefixResponse match) {
    absl::MutexLock lock(&mu_);
    match_ = std::move(match);
  }
  // The requests a unary method received, oldest first.
  template <typename Request>
  std::vector<Request> requests(const std::string& method) {
    absl::MutexLock lock(&mu_);
    std::vector<Request> out;
    for (const std::string& wire : requests_[method]) {
      out.emplace_back();
      EXPECT_TRUE(out.back().ParseFromString(wire));
    }
    return out;
  }
  // The last request of `method` (a default one when none came).
  template <typename Request>
  Request last(const std::string& method) {
    std::vector<Request> all = requests<Request>(method);
    EXPECT_FALSE(all.empty()) << "no " << method << " request arrived";
    return all.empty() ? Request() : all.back();
  }
  std::vector<v1::AppendRequest> appends() {
    absl::MutexLock lock(&mu_);
    return appends_;
  }
  v1::ReadSequenceRequest read_request() {
    absl::MutexLock lock(&mu_);
    return read_request_;
  }
  std::vector<std::string> list_tokens() {
    absl::MutexLock lock(&mu_);
    return list_tokens_;
  }
  int calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  // Deadlines seen, as seconds from the call's arrival.
  std::vector<double> deadlines() {
    absl::MutexLock lock(&mu_);
    return deadlines_;
  }

 private:
  template <typename Request>
  void Record(grpc::ServerContext* ctx, const std::string& method, const Request& request) {
    RecordDeadline(ctx);
    absl::MutexLock lock(&mu_);
    ++calls_;
    requests_[method].push_back(request.SerializeAsString());
  }
  void RecordDeadline(grpc::ServerContext* ctx) {
    const double left = std::chrono::duration<double>(ctx->deadline() - std::chrono::system_clock::now()).count();
    absl::MutexLock lock(&mu_);
    deadlines_.push_back(left);
  }

  absl::Mutex mu_;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::AppendRequest> appends_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ReadSequenceResponse> chunks_ ABSL_GUARDED_BY(mu_);
  v1::ReadSequenceRequest read_request_ ABSL_GUARDED_BY(mu_);
  v1::Pool pool_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ListSequencesResponse> list_pages_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> list_tokens_ ABSL_GUARDED_BY(mu_);
  std::vector<double> deadlines_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<std::string>> requests_ ABSL_GUARDED_BY(mu_);
  v1::Sequence sequence_ ABSL_GUARDED_BY(mu_);
  v1::Lease lease_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::ListLeasesResponse> lease_pages_ ABSL_GUARDED_BY(mu_);
  v1::ForkSequenceResponse fork_ ABSL_GUARDED_BY(mu_);
  v1::MatchPrefixResponse match_ ABSL_GUARDED_BY(mu_);
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
};

class KvCacheClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    // No SO_REUSEPORT: another test's server must never share this port.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }
  void TearDown() override { server_->Shutdown(); }

  std::unique_ptr<KvCacheClient> Client(size_t append_message_bytes = (4u << 20) - (64u << 10),
                                        absl::Duration timeout = absl::Seconds(30)) {
    absl::StatusOr<std::unique_ptr<KvCacheClient>> c = KvCacheClient::Create(
        {.target = "127.0.0.1:" + std::to_string(port_), .timeout = timeout,
         .append_message_bytes = append_message_bytes});
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  ScriptedKvCache service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// Distinct bytes per row so a message carrying the wrong slice shows.
std::string Rows(uint32_t rows, size_t row_bytes, char seed) {
  std::string out(rows * row_bytes, 0);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(seed + i / row_bytes);
  return out;
}

TEST_F(KvCacheClientTest, AppendSplitsRowsIntoMessagesOfTheConfiguredSize) {
  // Three rows' worth of bytes per message (two layers of ckv + kpe each).
  const size_t row_bytes = 2 * (kCkvRowBytes + kKpeRowBytes);
  auto client = Client(3 * row_bytes + row_bytes / 2);
  const std::string ckv0 = Rows(10, kCkvRowBytes, 'a'), kpe0 = Rows(10, kKpeRowBytes, 'A');
  const std::string ckv1 = Rows(10, kCkvRowBytes, 'k'), kpe1 = Rows(10, kKpeRowBytes, 'K');
  AppendRows append{.pool = "p", .sequence = "s", .start = 5, .rows = 10, .dtype = v1::ROW_DTYPE_FLOAT16,
                    .layers = {{.layer = 0, .ckv = ckv0, .kpe = kpe0, .ckv_scale = 2.0f},
                               {.layer = 7, .ckv = ckv1, .kpe = kpe1}},
                    .reserve_tokens = 64, .expect_length = 5, .view = v1::SEQUENCE_VIEW_BASIC};
  absl::StatusOr<v1::AppendResponse> r = client->Append(append);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sequence().id(), "s");

  const std::vector<v1::AppendRequest> got = service_.appends();
  ASSERT_EQ(got.size(), 4u);
  const uint32_t counts[] = {3, 3, 3, 1};
  uint32_t first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(i);
    const v1::AppendRequest& m = got[i];
    EXPECT_EQ(m.pool(), "p");
    EXPECT_EQ(m.sequence(), "s");
    EXPECT_EQ(m.start(), 5 + first);
    EXPECT_EQ(m.row_count(), counts[i]);
    EXPECT_EQ(m.dtype(), v1::ROW_DTYPE_FLOAT16);
    // Only the first message carries the stream's options.
    EXPECT_EQ(m.reserve_tokens(), i == 0 ? 64u : 0u);
    EXPECT_EQ(m.has_expect_length(), i == 0);
    EXPECT_EQ(m.view(), i == 0 ? v1::SEQUENCE_VIEW_BASIC : v1::SEQUENCE_VIEW_UNSPECIFIED);
    ASSERT_EQ(m.layers_size(), 2);
    EXPECT_EQ(m.layers(0).layer(), 0u);
    EXPECT_EQ(m.layers(1).layer(), 7u);
    EXPECT_EQ(m.layers(0).ckv(), ckv0.substr(first * kCkvRowBytes, counts[i] * kCkvRowBytes));
    EXPECT_EQ(m.layers(0).kpe(), kpe0.substr(first * kKpeRowBytes, counts[i] * kKpeRowBytes));
    EXPECT_EQ(m.layers(1).ckv(), ckv1.substr(first * kCkvRowBytes, counts[i] * kCkvRowBytes));
    EXPECT_EQ(m.layers(1).kpe(), kpe1.substr(first * kKpeRowBytes, counts[i] * kKpeRowBytes));
    // Scales ride on every message (the server checks they agree); 0 leaves the layer's own.
    EXPECT_FLOAT_EQ(m.layers(0).ckv_scale(), 2.0f);
    EXPECT_FLOAT_EQ(m.layers(0).kpe_scale(), 0.0f);
    EXPECT_FLOAT_EQ(m.layers(1).ckv_scale(), 0.0f);
    first += counts[i];
  }
  EXPECT_EQ(got[0].expect_length(), 5u);
}

TEST_F(KvCacheClientTest, RowsSentByReferenceArriveTheSameAndTheOwnerIsGivenBack) {
  const size_t row_bytes = kCkvRowBytes + kKpeRowBytes;
  auto client = Client(4 * row_bytes);
  auto owner = std::make_shared<std::pair<std::string, std::string>>(Rows(10, kCkvRowBytes, 'a'),
                                                                   Rows(10, kKpeRowBytes, 'A'));
  AppendRows append{.rows_owner = owner, .sequence = "s", .rows = 10,
                    .layers = {{.layer = 3, .ckv = owner->first, .kpe = owner->second, .ckv_scale = 2.0f}}};
  ASSERT_TRUE(client->Append(append).ok());
  const std::vector<v1::AppendRequest> got = service_.appends();
  ASSERT_EQ(got.size(), 3u);  // 4 + 4 + 2 rows
  std::string ckv, kpe;
  for (const v1::AppendRequest& m : got) {
    ASSERT_EQ(m.layers_size(), 1);
    EXPECT_EQ(m.layers(0).layer(), 3u);
    EXPECT_FLOAT_EQ(m.layers(0).ckv_scale(), 2.0f);
    ckv += m.layers(0).ckv();
    kpe += m.layers(0).kpe();
  }
  EXPECT_EQ(ckv, owner->first);
  EXPECT_EQ(kpe, owner->second);
  append.rows_owner.reset();
  // gRPC lets go once its transport has written the bytes (by now, or soon).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (owner.use_count() > 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(owner.use_count(), 1);
}

// A server that takes the call and never reads: the client's bytes stay
// queued in its transport past the deadline. The owner outlives Append's
// return (the caller drops its own reference at once) until gRPC is done with
// the bytes, and is then released, not leaked. Under ASan a read of freed row
// bytes by the transport would fail this test.
class NeverReadingAppend final : public v1::KvCache::WithRawCallbackMethod_Append<v1::KvCache::Service> {
 public:
  grpc::ServerReadReactor<grpc::ByteBuffer>* Append(grpc::CallbackServerContext*, grpc::ByteBuffer*) override {
    class Stall final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
     public:
      void OnCancel() override { Finish(grpc::Status::CANCELLED); }
      void OnDone() override { delete this; }
    };
    return new Stall;
  }
};

TEST(KvCacheClientOwnerTest, ACancelledAppendKeepsTheRowsAliveUntilTheTransportLetsGo) {
  NeverReadingAppend service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  std::weak_ptr<std::pair<std::string, std::string>> watch;
  {
    absl::StatusOr<std::unique_ptr<KvCacheClient>> client = KvCacheClient::Create(
        {.target = "127.0.0.1:" + std::to_string(port), .timeout = absl::Milliseconds(300)});
    ASSERT_TRUE(client.ok()) << client.status();
    {
      // 16 MiB of rows in 4 messages: far more than the stream's window.
      constexpr uint32_t kRows = 16 * 1024 * 1024 / (kCkvRowBytes + kKpeRowBytes);
      auto owner = std::make_shared<std::pair<std::string, std::string>>(Rows(kRows, kCkvRowBytes, 'a'),
                                                                       Rows(kRows, kKpeRowBytes, 'A'));
      watch = owner;
      AppendRows append{.rows_owner = owner, .sequence = "s", .rows = kRows,
                        .layers = {{.layer = 0, .ckv = owner->first, .kpe = owner->second}}};
      owner.reset();
      const absl::Status status = (*client)->Append(append).status();
      EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
    }  // the caller's last reference goes here
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!watch.expired() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_TRUE(watch.expired()) << "gRPC still holds the rows 10 s after the call ended";
  }
  server->Shutdown();
}

// AppendBatch with the request shared: its rows go out from where they are
// (client/append_wire.h SerializeReferencingBytes), and the server receives
// exactly the request, with the call's deadline; a status keeps its code and
// message; the request is given back once gRPC is done with its bytes.
TEST_F(KvCacheClientTest, AnAppendBatchByReferenceArrivesAsIsAndGivesItsRequestBack) {
  auto client = Client(4u << 20, absl::Seconds(7));
  auto request = std::make_shared<v1::AppendBatchRequest>();
  request->set_pool("p");
  request->set_dtype(v1::ROW_DTYPE_BFLOAT16);
  for (int i = 0; i < 3; ++i) {
    v1::SequenceRows* s = request->add_sequences();
    s->set_sequence("s" + std::to_string(i));
    s->set_start(5);
    s->set_row_count(16);
  }
  for (uint32_t layer = 0; layer < 4; ++layer) {  // 48 rows a layer: 48 KiB of ckv, 6 KiB of kpe
    v1::LayerRows* l = request->add_batch_layers();
    l->set_layer(layer);
    l->set_ckv(Rows(48, kCkvRowBytes, static_cast<char>('a' + layer)));
    l->set_kpe(Rows(48, kKpeRowBytes, static_cast<char>('A' + layer)));
  }
  std::weak_ptr<v1::AppendBatchRequest> watch = request;
  absl::StatusOr<v1::AppendBatchResponse> answer =
      client->AppendBatch(std::shared_ptr<const v1::AppendBatchRequest>(request));
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->rows_written(), 21u);
  std::vector<v1::AppendBatchRequest> got = service_.requests<v1::AppendBatchRequest>("AppendBatch");
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].SerializeAsString(), request->SerializeAsString());
  const std::vector<double> deadlines = service_.deadlines();
  ASSERT_FALSE(deadlines.empty());
  EXPECT_GT(deadlines.back(), 5.0);
  EXPECT_LE(deadlines.back(), 7.1);
  service_.Answer(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "scripted: no pages"));
  answer = client->AppendBatch(std::shared_ptr<const v1::AppendBatchRequest>(request));
  ASSERT_FALSE(answer.ok());
  EXPECT_EQ(answer.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(answer.status().message(), "scripted: no pages");
  EXPECT_EQ(client->AppendBatch(std::shared_ptr<const v1::AppendBatchRequest>()).status().code(),
            absl::StatusCode::kInternal);
  request.reset();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!watch.expired() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(watch.expired()) << "gRPC still holds the request 10 s after the calls ended";
}

TEST_F(KvCacheClientTest, AMessageHoldsAtLeastOneRowAndZeroRowsIsOneMessage) {
  auto client = Client(/*append_message_bytes=*/1);
  const std::string ckv = Rows(3, kCkvRowBytes, 'a'), kpe = Rows(3, kKpeRowBytes, 'A');
  ASSERT_TRUE(client->Append({.sequence = "s", .rows = 3, .layers = {{.layer = 0, .ckv = ckv, .kpe = kpe}}}).ok());
  EXPECT_EQ(service_.appends().size(), 3u);

  ASSERT_TRUE(client->Append({.sequence = "empty", .rows = 0, .layers = {{.layer = 0}}, .reserve_tokens = 128}).ok());
  const std::vector<v1::AppendRequest> got = service_.appends();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].row_count(), 0u);
  EXPECT_EQ(got[0].reserve_tokens(), 128u);
}

TEST_F(KvCacheClientTest, RegionRowsTravelAsReferencesThatAdvanceWithTheRows) {
  const size_t wire_row = kKpeRowBytes;  // only kpe travels as bytes
  auto client = Client(2 * wire_row);
  const std::string kpe = Rows(5, kKpeRowBytes, 'A');
  AppendRows append{.sequence = "s", .rows = 5,
                    .layers = {{.layer = 1, .kpe = kpe,
                                .ckv_region = RegionRows{.region = "r", .offset = 100, .row_stride_bytes = 2048}}}};
  ASSERT_TRUE(client->Append(append).ok());
  std::vector<v1::AppendRequest> got = service_.appends();
  ASSERT_EQ(got.size(), 3u);  // 2 + 2 + 1 rows
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(i);
    const v1::LayerRows& l = got[i].layers(0);
    EXPECT_TRUE(l.ckv().empty());
    ASSERT_TRUE(l.has_ckv_ref());
    EXPECT_EQ(l.ckv_ref().region(), "r");
    EXPECT_EQ(l.ckv_ref().offset(), 100 + i * 2 * 2048);
    EXPECT_EQ(l.ckv_ref().row_stride_bytes(), 2048u);
    EXPECT_EQ(l.kpe(), kpe.substr(i * 2 * kKpeRowBytes, got[i].row_count() * kKpeRowBytes));
  }

  // Packed rows (stride 0) advance by the row's own bytes; rows wholly in
  // regions are one message whatever their number.
  append.layers[0].kpe = {};
  append.layers[0].kpe_region = RegionRows{.region = "r2"};
  append.layers[0].ckv_region->row_stride_bytes = 0;
  append.rows = 1000;
  ASSERT_TRUE(client->Append(append).ok());
  got = service_.appends();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].row_count(), 1000u);
  EXPECT_EQ(got[0].layers(0).kpe_ref().offset(), 0u);
  EXPECT_EQ(got[0].layers(0).ckv_ref().offset(), 100u);
}

TEST_F(KvCacheClientTest, MalformedAppendsAreRefusedBeforeAnythingIsSent) {
  auto client = Client();
  const std::string ckv = Rows(2, kCkvRowBytes, 'a'), kpe = Rows(2, kKpeRowBytes, 'A');
  struct Case {
    const char* what;
    AppendRows append;
    const char* message;
  };
  const Case cases[] = {
      {"no dtype", {.sequence = "s", .rows = 2, .dtype = v1::ROW_DTYPE_UNSPECIFIED,
                    .layers = {{.ckv = ckv, .kpe = kpe}}}, "dtype is unspecified"},
      {"no id", {.rows = 2, .layers = {{.ckv = ckv, .kpe = kpe}}}, "sequence id is empty"},
      {"no layers", {.sequence = "s", .rows = 2}, "no layers given"},
      {"short ckv", {.sequence = "s", .rows = 3, .layers = {{.layer = 4, .ckv = ckv, .kpe = kpe}}},
       "append layer 4: ckv has 2048 bytes; rows(3) x 1024 bytes per row is 3072"},
      {"bytes and region",
       {.sequence = "s", .rows = 2, .layers = {{.ckv = ckv, .kpe = kpe, .kpe_region = RegionRows{.region = "r"}}}},
       "kpe has both 256 bytes and a region reference"},
      {"odd stride",
       {.sequence = "s", .rows = 2, .layers = {{.kpe = kpe, .ckv_region = RegionRows{.region = "r",
                                                                                .row_stride_bytes = 1025}}}},
       "row stride 1025 bytes must be 0 (packed) or an even number of at least the 1024 bytes"},
      {"unnamed region", {.sequence = "s", .rows = 2, .layers = {{.ckv = ckv, .kpe_region = RegionRows{}}}},
       "kpe region name is empty"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    absl::StatusOr<v1::AppendResponse> r = client->Append(c.append);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(c.message), absl::string_view::npos) << r.status();
  }
  EXPECT_EQ(service_.calls(), 0);
}

TEST_F(KvCacheClientTest, ServerStatusesKeepTheirCodeAndMessage) {
  auto client = Client();
  for (grpc::StatusCode code : {grpc::StatusCode::FAILED_PRECONDITION, grpc::StatusCode::RESOURCE_EXHAUSTED,
                                grpc::StatusCode::NOT_FOUND, grpc::StatusCode::UNAUTHENTICATED}) {
    SCOPED_TRACE(code);
    service_.Answer(grpc::Status(code, "scripted: 'seq' \\x00 says no"));
    absl::StatusOr<uint32_t> freed = client->Free("p", "seq");
    ASSERT_FALSE(freed.ok());
    EXPECT_EQ(static_cast<int>(freed.status().code()), static_cast<int>(code));
    EXPECT_EQ(freed.status().message(), "scripted: 'seq' \\x00 says no");
    const std::string ckv = Rows(1, kCkvRowBytes, 'a'), kpe = Rows(1, kKpeRowBytes, 'A');
    absl::StatusOr<v1::AppendResponse> r =
        client->Append({.sequence = "s", .rows = 1, .layers = {{.ckv = ckv, .kpe = kpe}}});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(static_cast<int>(r.status().code()), static_cast<int>(code));
  }
  service_.Answer(grpc::Status::OK);
  absl::StatusOr<uint32_t> freed = client->Free("p", "seq");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 3u);
}

TEST_F(KvCacheClientTest, EveryCallCarriesTheTimeoutAsItsDeadline) {
  auto client = Client(4u << 20, absl::Seconds(7));
  ASSERT_TRUE(client->Free("p", "s").ok());
  ASSERT_TRUE(client->GetPool("p").ok());
  ASSERT_TRUE(client->ReadLayer("p", "s", 0, 0, 0).ok());
  const std::string ckv = Rows(1, kCkvRowBytes, 'a'), kpe = Rows(1, kKpeRowBytes, 'A');
  ASSERT_TRUE(client->Append({.sequence = "s", .rows = 1, .layers = {{.ckv = ckv, .kpe = kpe}}}).ok());
  const std::vector<double> deadlines = service_.deadlines();
  ASSERT_GE(deadlines.size(), 4u);
  for (double left : deadlines) {
    EXPECT_GT(left, 5.0);
    EXPECT_LE(left, 7.1);  // gRPC rounds the timeout it sends up
  }
}

v1::ReadSequenceResponse Chunk(uint32_t layer, uint32_t start, uint32_t count, char seed) {
  v1::ReadSequenceResponse c;
  c.set_layer(layer);
  c.set_start(start);
  c.set_count(count);
  c.set_ckv_packed(std::string(count * 256, seed));
  c.set_ckv_sf(std::string(count * 32, seed + 1));
  c.set_kpe(std::string(count * 64, seed + 2));
  c.set_ckv_scale(0.5f);
  c.set_kpe_scale(0.25f);
  return c;
}

TEST_F(KvCacheClientTest, ReadLayerJoinsChunksInTokenOrder) {
  auto client = Client();
  service_.Chunks({Chunk(3, 10, 4, 'a'), Chunk(3, 14, 2, 'x')});
  absl::StatusOr<StoredLayer> stored = client->ReadLayer("p", "s", 3, 10, 6);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->layer, 3u);
  EXPECT_EQ(stored->start, 10u);
  EXPECT_EQ(stored->count, 6u);
  EXPECT_EQ(stored->ckv_packed, std::string(4 * 256, 'a') + std::string(2 * 256, 'x'));
  EXPECT_EQ(stored->ckv_sf, std::string(4 * 32, 'b') + std::string(2 * 32, 'y'));
  EXPECT_EQ(stored->kpe, std::string(4 * 64, 'c') + std::string(2 * 64, 'z'));
  EXPECT_FLOAT_EQ(stored->ckv_scale, 0.5f);
  EXPECT_FLOAT_EQ(stored->kpe_scale, 0.25f);
  const v1::ReadSequenceRequest sent = service_.read_request();
  EXPECT_EQ(sent.pool(), "p");
  EXPECT_EQ(sent.sequence(), "s");
  ASSERT_EQ(sent.layers_size(), 1);
  EXPECT_EQ(sent.layers(0), 3u);
  EXPECT_EQ(sent.start(), 10u);
  EXPECT_EQ(sent.count(), 6u);
  EXPECT_EQ(sent.format(), v1::READ_FORMAT_RAW);
}

TEST_F(KvCacheClientTest, ReadLayerRefusesChunksThatDoNotFollowEachOther) {
  auto client = Client();
  v1::ReadSequenceResponse short_bytes = Chunk(0, 4, 2, 'b');
  short_bytes.mutable_kpe()->pop_back();
  const std::vector<std::pair<const char*, std::vector<v1::ReadSequenceResponse>>> cases = {
      {"a gap", {Chunk(0, 0, 4, 'a'), Chunk(0, 5, 2, 'b')}},
      {"another layer", {Chunk(0, 0, 4, 'a'), Chunk(1, 4, 2, 'b')}},
      {"short bytes", {Chunk(0, 0, 4, 'a'), short_bytes}},
  };
  for (const auto& [what, chunks] : cases) {
    SCOPED_TRACE(what);
    service_.Chunks(chunks);
    absl::StatusOr<StoredLayer> stored = client->ReadLayer("p", "s", 0, 0, 6);
    ASSERT_FALSE(stored.ok());
    EXPECT_EQ(stored.status().code(), absl::StatusCode::kInternal);
    EXPECT_NE(stored.status().message().find("does not follow layer 0 token 4"), absl::string_view::npos)
        << stored.status();
  }
  // The stream's own error wins over what the chunks said.
  service_.Chunks({Chunk(0, 0, 4, 'a'), Chunk(0, 9, 1, 'b')});
  service_.Answer(grpc::Status(grpc::StatusCode::ABORTED, "scripted abort"));
  absl::StatusOr<StoredLayer> stored = client->ReadLayer("p", "s", 0, 0, 6);
  ASSERT_FALSE(stored.ok());
  EXPECT_EQ(stored.status().code(), absl::StatusCode::kAborted);
}

TEST_F(KvCacheClientTest, AnEmptyReadTakesTheScalesFromThePool) {
  auto client = Client();
  v1::Pool pool;
  pool.add_layers()->set_ckv_scale(1.0f);
  v1::LayerScales* l1 = pool.add_layers();
  l1->set_ckv_scale(3.0f);
  l1->set_kpe_scale(4.0f);
  service_.PoolInfo(pool);
  absl::StatusOr<StoredLayer> stored = client->ReadLayer("p", "s", 1, 0, 0);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->count, 0u);
  EXPECT_FLOAT_EQ(stored->ckv_scale, 3.0f);
  EXPECT_FLOAT_EQ(stored->kpe_scale, 4.0f);
}

TEST_F(KvCacheClientTest, ListSequencesFollowsPageTokensAndStopsOnALoop) {
  auto client = Client();
  v1::ListSequencesResponse a, b, c;
  a.add_sequences()->set_id("s1");
  a.set_next_page_token("t1");
  b.add_sequences()->set_id("s2");
  b.add_sequences()->set_id("s3");
  b.set_next_page_token("t2");
  c.add_sequences()->set_id("s4");
  service_.ListPages({a, b, c});
  absl::StatusOr<std::vector<v1::SequenceSummary>> all = client->ListSequences("p");
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 4u);
  EXPECT_EQ((*all)[3].id(), "s4");
  EXPECT_EQ(service_.list_tokens(), (std::vector<std::string>{"", "t1", "t2"}));

  // A server that hands back the token it was given would loop forever.
  v1::ListSequencesResponse again;
  again.set_next_page_token("t1");
  service_.ListPages({a, again, again, again});
  absl::StatusOr<std::vector<v1::SequenceSummary>> looped = Client()->ListSequences("p");
  ASSERT_FALSE(looped.ok());
  EXPECT_EQ(looped.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(looped.status().message().find("same page token twice"), absl::string_view::npos);
}

// ---- cache management ----

v1::Lease ScriptedLease() {
  v1::Lease lease;
  lease.set_pool("p");
  lease.set_lease_id(42);
  lease.set_sequence("s");
  lease.set_generation(1234567890123ull);
  lease.set_holder("worker-1");
  lease.set_tokens(32);
  lease.set_expire_time_unix_ms(1700000000000);
  lease.set_duration_ms(1500);
  return lease;
}

TEST_F(KvCacheClientTest, AcquireRenewReleaseSendTheirFieldsAndMapTheAnswers) {
  auto client = Client();
  service_.LeaseAnswer(ScriptedLease());
  absl::StatusOr<v1::Lease> lease = client->AcquireLease("p", "s", "worker-1", absl::Milliseconds(1500), 32, 77);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->lease_id(), 42u);
  EXPECT_EQ(lease->generation(), 1234567890123ull);
  EXPECT_EQ(lease->expire_time_unix_ms(), 1700000000000);
  v1::AcquireLeaseRequest sent = service_.last<v1::AcquireLeaseRequest>("AcquireLease");
  EXPECT_EQ(sent.pool(), "p");
  EXPECT_EQ(sent.sequence(), "s");
  EXPECT_EQ(sent.lease().holder(), "worker-1");
  EXPECT_EQ(sent.lease().duration_ms(), 1500u);
  EXPECT_EQ(sent.tokens(), 32u);
  ASSERT_TRUE(sent.has_expect_generation());
  EXPECT_EQ(sent.expect_generation(), 77u);

  // Defaults: the pool's duration, the sequence's length, no generation; a
  // duration is sent as whole milliseconds, rounded up.
  ASSERT_TRUE(client->AcquireLease("", "s", "h").ok());
  sent = service_.last<v1::AcquireLeaseRequest>("AcquireLease");
  EXPECT_EQ(sent.lease().duration_ms(), 0u);
  EXPECT_EQ(sent.tokens(), 0u);
  EXPECT_FALSE(sent.has_expect_generation());
  ASSERT_TRUE(client->AcquireLease("", "s", "h", absl::Microseconds(1001)).ok());
  EXPECT_EQ(service_.last<v1::AcquireLeaseRequest>("AcquireLease").lease().duration_ms(), 2u);

  ASSERT_TRUE(client->RenewLease("p", 42, absl::Seconds(3)).ok());
  const v1::RenewLeaseRequest renew = service_.last<v1::RenewLeaseRequest>("RenewLease");
  EXPECT_EQ(renew.pool(), "p");
  EXPECT_EQ(renew.lease_id(), 42u);
  EXPECT_EQ(renew.duration_ms(), 3000u);

  absl::StatusOr<uint32_t> freed = client->ReleaseLease("p", 42);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 4u);
  EXPECT_EQ(service_.last<v1::ReleaseLeaseRequest>("ReleaseLease").lease_id(), 42u);

  // Durations the wire cannot carry are refused before sending.
  const int before = service_.calls();
  for (absl::Duration bad : {absl::Milliseconds(-1), absl::Hours(24 * 60)}) {
    SCOPED_TRACE(absl::FormatDuration(bad));
    absl::StatusOr<v1::Lease> refused = client->AcquireLease("p", "s", "h", bad);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find("lease duration"), absl::string_view::npos) << refused.status();
    EXPECT_EQ(client->RenewLease("p", 1, bad).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(client->MatchPrefix("p", {"h"}, LeaseTerms{.holder = "h", .duration = bad}).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(client->GetSequence("p", "s", {.lease = LeaseTerms{.holder = "h", .duration = bad}}).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(service_.calls(), before);
}

TEST_F(KvCacheClientTest, ListLeasesFollowsPageTokensAndStopsOnALoop) {
  auto client = Client();
  v1::ListLeasesResponse a, b;
  a.add_leases()->set_lease_id(1);
  a.add_leases()->set_lease_id(2);
  a.set_next_page_token("2");
  b.add_leases()->set_lease_id(5);
  b.set_total(3);
  service_.LeasePages({a, b});
  absl::StatusOr<std::vector<v1::Lease>> all = client->ListLeases("p");
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 3u);
  EXPECT_EQ((*all)[2].lease_id(), 5u);
  const std::vector<v1::ListLeasesRequest> sent = service_.requests<v1::ListLeasesRequest>("ListLeases");
  ASSERT_EQ(sent.size(), 2u);
  EXPECT_EQ(sent[0].pool(), "p");
  EXPECT_EQ(sent[0].page_token(), "");
  EXPECT_EQ(sent[1].page_token(), "2");
  EXPECT_EQ(sent[1].page_size(), sent[0].page_size());

  v1::ListLeasesResponse again;
  again.set_next_page_token("2");
  service_.LeasePages({a, again, again});
  absl::StatusOr<std::vector<v1::Lease>> looped = client->ListLeases("p");
  ASSERT_FALSE(looped.ok());
  EXPECT_EQ(looped.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(looped.status().message().find("same page token twice"), absl::string_view::npos);
}

TEST_F(KvCacheClientTest, GetSequenceSendsItsOptionsOnlyWhenAsked) {
  auto client = Client();
  v1::Sequence seq;
  seq.set_id("s");
  seq.set_generation(99);
  seq.set_leases(1);
  seq.set_pinned(true);
  seq.set_shared_pages(2);
  *seq.mutable_lease() = ScriptedLease();
  service_.SequenceAnswer(seq);

  ASSERT_TRUE(client->GetSequence("p", "s").ok());
  v1::GetSequenceRequest sent = service_.last<v1::GetSequenceRequest>("GetSequence");
  EXPECT_EQ(sent.pool(), "p");
  EXPECT_EQ(sent.sequence(), "s");
  EXPECT_FALSE(sent.has_expect_generation());
  EXPECT_FALSE(sent.has_lease());

  absl::StatusOr<v1::Sequence> got = client->GetSequence(
      "p", "s", {.expect_generation = 99, .lease = LeaseTerms{.holder = "reader", .duration = absl::Seconds(2)}});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->generation(), 99u);
  EXPECT_TRUE(got->pinned());
  EXPECT_EQ(got->shared_pages(), 2u);
  EXPECT_EQ(got->lease().lease_id(), 42u);
  sent = service_.last<v1::GetSequenceRequest>("GetSequence");
  ASSERT_TRUE(sent.has_expect_generation());
  EXPECT_EQ(sent.expect_generation(), 99u);
  ASSERT_TRUE(sent.has_lease());
  EXPECT_EQ(sent.lease().holder(), "reader");
  EXPECT_EQ(sent.lease().duration_ms(), 2000u);

  // Only a precondition: no lease.
  ASSERT_TRUE(client->GetSequence("p", "s", {.expect_generation = 0}).ok());
  sent = service_.last<v1::GetSequenceRequest>("GetSequence");
  EXPECT_TRUE(sent.has_expect_generation());
  EXPECT_EQ(sent.expect_generation(), 0u);
  EXPECT_FALSE(sent.has_lease());
}

TEST_F(KvCacheClientTest, GenerationsAndLeaseIdsReachFreeTruncateAndRead) {
  auto client = Client();
  absl::StatusOr<v1::FreeSequenceResponse> freed = client->FreeSequence("p", "s", 7);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(freed->pages_freed(), 3u);
  EXPECT_EQ(freed->leases(), 2u);
  EXPECT_EQ(freed->pages_retained(), 5u);
  v1::FreeSequenceRequest free = service_.last<v1::FreeSequenceRequest>("FreeSequence");
  EXPECT_TRUE(free.has_expect_generation());
  EXPECT_EQ(free.expect_generation(), 7u);
  ASSERT_TRUE(client->Free("p", "s").ok());
  EXPECT_FALSE(service_.last<v1::FreeSequenceRequest>("FreeSequence").has_expect_generation());

  ASSERT_TRUE(client->Truncate("p", "s", 10, 8).ok());
  v1::TruncateSequenceRequest truncate = service_.last<v1::TruncateSequenceRequest>("TruncateSequence");
  EXPECT_EQ(truncate.length(), 10u);
  EXPECT_EQ(truncate.expect_generation(), 8u);
  ASSERT_TRUE(client->Truncate("p", "s", 10).ok());
  EXPECT_FALSE(service_.last<v1::TruncateSequenceRequest>("TruncateSequence").has_expect_generation());

  service_.Chunks({Chunk(2, 4, 3, 'a')});
  absl::StatusOr<StoredLayer> read =
      client->ReadLayer("p", "", 2, {.start = 4, .count = 3, .expect_generation = 9, .lease_id = 42});
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->count, 3u);
  const v1::ReadSequenceRequest sent = service_.read_request();
  EXPECT_EQ(sent.sequence(), "");
  EXPECT_EQ(sent.start(), 4u);
  EXPECT_EQ(sent.count(), 3u);
  EXPECT_EQ(sent.expect_generation(), 9u);
  EXPECT_EQ(sent.lease_id(), 42u);
  ASSERT_TRUE(client->ReadLayer("p", "s", 2, 4, 3).ok());
  EXPECT_FALSE(service_.read_request().has_expect_generation());
  EXPECT_EQ(service_.read_request().lease_id(), 0u);
}

TEST_F(KvCacheClientTest, ForksSendASourceOrAHashChain) {
  auto client = Client();
  v1::ForkSequenceResponse answer;
  answer.mutable_sequence()->set_id("t");
  answer.mutable_sequence()->set_length(40);
  answer.set_pages_shared(2);
  answer.set_pages_copied(1);
  service_.ForkAnswer(answer);

  absl::StatusOr<v1::ForkSequenceResponse> fork = client->ForkSequence("p", "src", "t", 40, true, 5);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(fork->sequence().id(), "t");
  EXPECT_EQ(fork->pages_shared(), 2u);
  EXPECT_EQ(fork->pages_copied(), 1u);
  v1::ForkSequenceRequest sent = service_.last<v1::ForkSequenceRequest>("ForkSequence");
  EXPECT_EQ(sent.pool(), "p");
  EXPECT_EQ(sent.source(), "src");
  EXPECT_EQ(sent.target(), "t");
  EXPECT_EQ(sent.length(), 40u);
  EXPECT_TRUE(sent.pin());
  EXPECT_EQ(sent.expect_generation(), 5u);
  EXPECT_EQ(sent.block_hashes_size(), 0);
  ASSERT_TRUE(client->ForkSequence("p", "src", "t").ok());
  sent = service_.last<v1::ForkSequenceRequest>("ForkSequence");
  EXPECT_EQ(sent.length(), 0u);
  EXPECT_FALSE(sent.pin());
  EXPECT_FALSE(sent.has_expect_generation());

  // By hash; a chain that matched nothing comes back without a sequence.
  service_.ForkAnswer(v1::ForkSequenceResponse());
  const std::vector<std::string> hashes = {std::string("\x00\x01", 2), "h1", std::string(64, 'z')};
  absl::StatusOr<v1::ForkSequenceResponse> by_hash = client->ForkFromHashes("p", hashes, "t2", true);
  ASSERT_TRUE(by_hash.ok()) << by_hash.status();
  EXPECT_FALSE(by_hash->has_sequence());
  sent = service_.last<v1::ForkSequenceRequest>("ForkSequence");
  EXPECT_EQ(sent.source(), "");
  EXPECT_EQ(sent.target(), "t2");
  EXPECT_TRUE(sent.pin());
  EXPECT_EQ(std::vector<std::string>(sent.block_hashes().begin(), sent.block_hashes().end()), hashes);

  // A fork with neither a source nor a hash is refused before sending.
  const int before = service_.calls();
  EXPECT_EQ(client->ForkSequence("p", "", "t").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->ForkFromHashes("p", {}, "t").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(service_.calls(), before);
}

TEST_F(KvCacheClientTest, MatchPrefixSendsTheChainInOrderAndALeaseWhenAsked) {
  auto client = Client();
  v1::MatchPrefixResponse answer;
  answer.set_matched_pages(2);
  answer.set_matched_tokens(32);
  answer.add_kv_indices(7);
  answer.add_kv_indices(3);
  service_.MatchAnswer(answer);
  const std::vector<std::string> hashes = {"a", "b", "c"};
  absl::StatusOr<v1::MatchPrefixResponse> match = client->MatchPrefix("p", hashes);
  ASSERT_TRUE(match.ok()) << match.status();
  EXPECT_EQ(match->matched_pages(), 2u);
  EXPECT_EQ(match->matched_tokens(), 32u);
  EXPECT_EQ(std::vector<uint32_t>(match->kv_indices().begin(), match->kv_indices().end()),
            (std::vector<uint32_t>{7, 3}));
  v1::MatchPrefixRequest sent = service_.last<v1::MatchPrefixRequest>("MatchPrefix");
  EXPECT_EQ(sent.pool(), "p");
  EXPECT_EQ(std::vector<std::string>(sent.block_hashes().begin(), sent.block_hashes().end()), hashes);
  EXPECT_FALSE(sent.has_lease());

  *answer.mutable_lease() = ScriptedLease();
  service_.MatchAnswer(answer);
  match = client->MatchPrefix("p", hashes, LeaseTerms{.holder = "prefetch", .duration = absl::Seconds(1)});
  ASSERT_TRUE(match.ok()) << match.status();
  EXPECT_EQ(match->lease().lease_id(), 42u);
  sent = service_.last<v1::MatchPrefixRequest>("MatchPrefix");
  ASSERT_TRUE(sent.has_lease());
  EXPECT_EQ(sent.lease().holder(), "prefetch");
  EXPECT_EQ(sent.lease().duration_ms(), 1000u);
}

TEST_F(KvCacheClientTest, AppendCacheFieldsRideOnlyOnTheFirstMessage) {
  auto client = Client(/*append_message_bytes=*/1);  // one row per message
  const std::string ckv = Rows(3, kCkvRowBytes, 'a'), kpe = Rows(3, kKpeRowBytes, 'A');
  AppendRows append{.sequence = "s", .rows = 3, .layers = {{.layer = 0, .ckv = ckv, .kpe = kpe}},
                    .expect_generation = 11, .block_hashes = {"h0", "h1"}, .block_hashes_first_page = 4,
                    .pin = true};
  ASSERT_TRUE(client->Append(append).ok());
  const std::vector<v1::AppendRequest> got = service_.appends();
  ASSERT_EQ(got.size(), 3u);
  EXPECT_TRUE(got[0].has_expect_generation());
  EXPECT_EQ(got[0].expect_generation(), 11u);
  EXPECT_EQ(std::vector<std::string>(got[0].block_hashes().begin(), got[0].block_hashes().end()),
            (std::vector<std::string>{"h0", "h1"}));
  EXPECT_EQ(got[0].block_hashes_first_page(), 4u);
  EXPECT_TRUE(got[0].pin());
  for (size_t i = 1; i < got.size(); ++i) {
    SCOPED_TRACE(i);
    // The server refuses expect_generation and pin after the first message.
    EXPECT_FALSE(got[i].has_expect_generation());
    EXPECT_FALSE(got[i].pin());
    EXPECT_EQ(got[i].block_hashes_size(), 0);
    EXPECT_EQ(got[i].block_hashes_first_page(), 0u);
  }
  // Unset: nothing on the wire.
  ASSERT_TRUE(client->Append({.sequence = "s", .rows = 1, .layers = {{.ckv = ckv.substr(0, kCkvRowBytes),
                                                                      .kpe = kpe.substr(0, kKpeRowBytes)}}})
                  .ok());
  const v1::AppendRequest plain = service_.appends().at(0);
  EXPECT_FALSE(plain.has_expect_generation());
  EXPECT_FALSE(plain.pin());
  EXPECT_EQ(plain.block_hashes_size(), 0);
}

TEST_F(KvCacheClientTest, CacheManagementErrorsKeepTheirCodeAndMessage) {
  auto client = Client();
  for (grpc::StatusCode code : {grpc::StatusCode::NOT_FOUND, grpc::StatusCode::FAILED_PRECONDITION,
                                grpc::StatusCode::RESOURCE_EXHAUSTED, grpc::StatusCode::ALREADY_EXISTS}) {
    SCOPED_TRACE(code);
    const std::string message = absl::StrCat("scripted ", static_cast<int>(code));
    service_.Answer(grpc::Status(code, message));
    const std::vector<std::pair<const char*, absl::Status>> statuses = {
        {"AcquireLease", client->AcquireLease("p", "s", "h").status()},
        {"RenewLease", client->RenewLease("p", 1).status()},
        {"ReleaseLease", client->ReleaseLease("p", 1).status()},
        {"ListLeases", client->ListLeases("p").status()},
        {"ForkSequence", client->ForkSequence("p", "a", "b").status()},
        {"ForkFromHashes", client->ForkFromHashes("p", {"h"}, "b").status()},
        {"MatchPrefix", client->MatchPrefix("p", {"h"}).status()},
        {"GetSequence", client->GetSequence("p", "s", {.expect_generation = 1}).status()},
        {"FreeSequence", client->FreeSequence("p", "s", 1).status()},
    };
    for (const auto& [what, status] : statuses) {
      SCOPED_TRACE(what);
      EXPECT_EQ(static_cast<int>(status.code()), static_cast<int>(code));
      EXPECT_EQ(status.message(), message);
    }
  }
}

TEST(KvCacheClientCreate, RefusesOptionsThatCannotWork) {
  struct Case {
    const char* what;
    KvCacheClient::Options options;
    const char* message;
  };
  const Case cases[] = {
      {"no target", {.target = ""}, "target (host:port) is empty"},
      {"zero timeout", {.timeout = absl::ZeroDuration()}, "timeout must be positive"},
      {"zero message bytes", {.append_message_bytes = 0}, "append_message_bytes must be positive"},
      {"token in plaintext", {.token = "secret"}, "a bearer token needs TLS"},
      {"cert without key", {.tls_ca_file = "/ca.pem", .tls_cert_file = "/c.pem"}, "certificate and its key go together"},
      {"cert without ca", {.tls_cert_file = "/c.pem", .tls_key_file = "/k.pem"}, "a client certificate needs a TLS CA"},
      {"missing ca file", {.tls_ca_file = "/nonexistent/ca.pem"}, "TLS CA /nonexistent/ca.pem: cannot open"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    absl::StatusOr<std::unique_ptr<KvCacheClient>> client = KvCacheClient::Create(c.options);
    ASSERT_FALSE(client.ok());
    EXPECT_NE(client.status().message().find(c.message), absl::string_view::npos) << client.status();
  }
}

}  // namespace
}  // namespace mlakv
