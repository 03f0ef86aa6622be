// Regions on the cpu backend, in process: POSIX shared-memory objects written
// with rows, registered, and named by appends (Append and AppendBatch, packed
// and strided rows) store exactly the bytes the same rows sent as bytes store;
// every refusal (no --allow_ipc, duplicate, unknown, out of range, bad handle
// size, malformed refs) with its code and nothing written; unregister while
// an append stream holds the region. Pool invariants after every test.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "tests/server/rpc/region_helpers.h"
#include "tests/server/rpc/service_fixture.h"
#include "tests/testing/shm_object.h"

namespace mlakv::server::testing {
namespace {

using mlakv::testing::ShmObject;

class RegionServiceTest : public ::testing::Test, public ServiceFixture {
 protected:
  void SetUp() override { Start(true); }
  void TearDown() override {
    absl::Status inv = pool().CheckInvariants();
    EXPECT_TRUE(inv.ok()) << inv;
    StopServer();
  }
  void Start(bool allow_ipc) {
    set_allow_ipc(allow_ipc);
    // 4 layers, 16-token pages, 32 pages = 512 tokens.
    StartServer("cpu", "name: 'default' num_layers: 4 page_size: 16 num_pages: 32");
  }

  grpc::Status RegisterShm(const std::string& name, const std::string& shm_name, uint64_t offset, uint64_t bytes,
                           v1::Region* out = nullptr) {
    v1::RegisterShmRegionRequest req;
    req.set_name(name);
    req.set_shm_name(shm_name);
    req.set_offset(offset);
    req.set_byte_size(bytes);
    v1::Region local;
    grpc::ClientContext ctx;
    return stub().RegisterShmRegion(&ctx, req, out ? out : &local);
  }
  grpc::Status RegisterCuda(const std::string& name, const std::string& raw_handle, uint64_t bytes) {
    v1::RegisterCudaRegionRequest req;
    req.set_name(name);
    req.set_raw_handle(raw_handle);
    req.set_byte_size(bytes);
    v1::Region region;
    grpc::ClientContext ctx;
    return stub().RegisterCudaRegion(&ctx, req, &region);
  }
  grpc::Status List(v1::ListRegionsResponse* out) {
    grpc::ClientContext ctx;
    return stub().ListRegions(&ctx, v1::ListRegionsRequest(), out);
  }
};

TEST_F(RegionServiceTest, ShmAppendStoresTheSameBytesAsBytesAppend) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    const std::string tag = dtype == DType::kBFloat16 ? "bf16" : "fp16";
    const Rows rows = RandomRows(37, 11, dtype);
    // ckv rows at 4096 (after a header the producer keeps), kpe rows after them.
    const uint64_t ckv_off = 4096, kpe_off = ckv_off + rows.n * kCkvRow;
    ShmObject shm(kpe_off + rows.n * kKpeRow);
    std::memcpy(shm.data() + ckv_off, rows.ckv.data(), rows.n * kCkvRow);
    std::memcpy(shm.data() + kpe_off, rows.kpe.data(), rows.n * kKpeRow);
    v1::Region reg;
    grpc::Status s = RegisterShm("r-" + tag, shm.name(), 0, 0, &reg);
    ASSERT_TRUE(s.ok()) << Describe(s);
    EXPECT_EQ(reg.kind(), v1::REGION_KIND_SHM);
    EXPECT_EQ(reg.byte_size(), kpe_off + rows.n * kKpeRow);

    v1::AppendResponse resp;
    s = Append({RegionMessage("ipc-" + tag, 0, rows.n, dtype, {0, 2}, Ref("r-" + tag, ckv_off),
                              Ref("r-" + tag, kpe_off))},
               &resp);
    ASSERT_TRUE(s.ok()) << Describe(s);
    EXPECT_EQ(resp.rows_written(), 2u * rows.n);
    s = AppendRows("bytes-" + tag, 0, rows, {0, 2}, kCkvScale, kKpeScale);
    ASSERT_TRUE(s.ok()) << Describe(s);
    ExpectSameStored("ipc-" + tag, "bytes-" + tag, {0, 2}, rows.n);
    s = Unregister("r-" + tag);
    ASSERT_TRUE(s.ok()) << Describe(s);
  }
}

TEST_F(RegionServiceTest, StridedRowsAtARegionOffset) {
  // The producer's layout: per row ckv, kpe, 64 bytes of padding; the region
  // starts 8192 bytes into the object (not page-aligned offsets inside it).
  const Rows rows = RandomRows(21, 12);
  const uint64_t stride = kCkvRow + kKpeRow + 64, region_off = 8192 + 100, first = 36;
  ShmObject shm(region_off + first + rows.n * stride);
  WriteStridedRows(rows, shm.data() + region_off + first, stride);
  grpc::Status s = RegisterShm("strided", shm.name(), region_off, first + rows.n * stride);
  ASSERT_TRUE(s.ok()) << Describe(s);
  s = Append({RegionMessage("ipc", 0, rows.n, rows.dtype, {1}, Ref("strided", first, stride),
                            Ref("strided", first + kCkvRow, stride))});
  ASSERT_TRUE(s.ok()) << Describe(s);
  s = AppendRows("bytes", 0, rows, {1}, kCkvScale, kKpeScale);
  ASSERT_TRUE(s.ok()) << Describe(s);
  ExpectSameStored("ipc", "bytes", {1}, rows.n);
}

TEST_F(RegionServiceTest, AppendBatchFromARegion) {
  // Three sequences, 2 rows each, one region; the third sends bytes.
  const Rows rows = RandomRows(6, 13);
  ShmObject shm(rows.n * (kCkvRow + kKpeRow));
  std::memcpy(shm.data(), rows.ckv.data(), rows.n * kCkvRow);
  std::memcpy(shm.data() + rows.n * kCkvRow, rows.kpe.data(), rows.n * kKpeRow);
  grpc::Status s = RegisterShm("batch", shm.name(), 0, 0);
  ASSERT_TRUE(s.ok()) << Describe(s);
  v1::AppendBatchRequest req;
  req.set_dtype(ProtoDType(rows.dtype));
  for (int i = 0; i < 3; ++i) {
    v1::LayerRows* lr = AddBatchLayer(req, "b" + std::to_string(i), 2, 3);
    if (i < 2) {
      *lr->mutable_ckv_ref() = Ref("batch", i * 2 * kCkvRow);
      *lr->mutable_kpe_ref() = Ref("batch", rows.n * kCkvRow + i * 2 * kKpeRow);
    } else {
      lr->set_ckv(rows.ckv_bytes(4, 2));
      lr->set_kpe(rows.kpe_bytes(4, 2));
    }
  }
  v1::AppendBatchResponse resp;
  grpc::ClientContext ctx;
  s = stub().AppendBatch(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(resp.rows_written(), 6u);
  s = AppendRows("bytes", 0, rows, {3}, kCkvScale, kKpeScale);
  ASSERT_TRUE(s.ok()) << Describe(s);
  Stored all = Read("bytes", 3, 0, 6);
  ASSERT_TRUE(all.status.ok()) << Describe(all.status);
  for (int i = 0; i < 3; ++i) {
    Stored one = Read("b" + std::to_string(i), 3, 0, 2);
    ASSERT_TRUE(one.status.ok()) << Describe(one.status);
    ExpectRowsOf(one.rows, all.rows, i * 2, 2);
  }
}

// An AppendBatch that keeps the queue thread that took it for long (262,144
// rows x layers quantized on the cpu, a tenth of a second or more) passes
// the queue's turn on first: a GetPool on another connection is answered
// while it runs. (A batch of at most kKeepTurnRowLayers rows x layers keeps
// the turn, kv_cache_service.cc: a matter of latency, which rpc_floor_bench
// measures.)
TEST_F(RegionServiceTest, ALongAppendBatchLetsAnotherConnectionsCallThrough) {
  StopServer();
  StartServer("cpu", "name: 'default' num_layers: 4 page_size: 64 num_pages: 1040", "", "127.0.0.1:0");
  ASSERT_GE(server().rpc_threads(), 2);
  const uint64_t n = 65536;
  ShmObject shm(n * (kCkvRow + kKpeRow));
  std::memset(shm.data(), 0x3c, n * (kCkvRow + kKpeRow));  // bf16 1.4609375 everywhere
  grpc::Status s = RegisterShm("long", shm.name(), 0, 0);
  ASSERT_TRUE(s.ok()) << Describe(s);
  v1::AppendBatchRequest req;
  req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  v1::SequenceRows* seq = req.add_sequences();
  seq->set_sequence("long");
  seq->set_row_count(static_cast<uint32_t>(n));
  for (uint32_t l = 0; l < 4; ++l) {
    v1::LayerRows* lr = req.add_batch_layers();
    lr->set_layer(l);
    lr->set_ckv_scale(kCkvScale);
    lr->set_kpe_scale(kKpeScale);
    *lr->mutable_ckv_ref() = Ref("long", 0);
    *lr->mutable_kpe_ref() = Ref("long", n * kCkvRow);
  }
  grpc::Status long_status;
  absl::Time long_done;
  std::thread batch([&] {
    grpc::ClientContext ctx;
    v1::AppendBatchResponse resp;
    long_status = stub().AppendBatch(&ctx, req, &resp);
    long_done = absl::Now();
  });
  // Until the batch's task runs (the pool's worker counts it, inline or not).
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (pool().worker().pending() == 0 && absl::Now() < give_up) absl::SleepFor(absl::Microseconds(100));
  const bool started = pool().worker().pending() > 0;
  auto other = v1::KvCache::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(server().bound_port()),
                                                        grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::Pool answer;
  const grpc::Status got = other->GetPool(&ctx, v1::GetPoolRequest(), &answer);
  const absl::Time answered = absl::Now();
  const bool batch_still_running = pool().worker().pending() > 0;
  batch.join();
  ASSERT_TRUE(started) << "the batch's task never started";
  EXPECT_TRUE(got.ok()) << Describe(got);
  ASSERT_TRUE(long_status.ok()) << Describe(long_status);
  EXPECT_TRUE(batch_still_running && answered < long_done)
      << "GetPool on another connection was answered only once the long AppendBatch had finished ("
      << absl::FormatDuration(answered - long_done) << " after it)";
  v1::Sequence written;
  ASSERT_TRUE(GetSequence("long", &written).ok());
  EXPECT_EQ(written.length(), n);
}

TEST_F(RegionServiceTest, EverythingRefusedWithoutAllowIpc) {
  StopServer();
  Start(false);
  ShmObject shm(1 << 16);
  grpc::Status s = RegisterShm("r", shm.name(), 0, 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(s);
  EXPECT_NE(s.error_message().find("--allow_ipc"), std::string::npos) << Describe(s);
  s = RegisterCuda("c", std::string(64, '\0'), 1024);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(s);
  s = Unregister("r");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(s);
  v1::ListRegionsResponse list;
  s = List(&list);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(s);
  s = Append({RegionMessage("s", 0, 1, DType::kBFloat16, {0}, Ref("r", 0), Ref("r", kCkvRow))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(s);
  EXPECT_EQ(GetPool().pages_used(), 0u);
}

TEST_F(RegionServiceTest, DuplicateNameIsAlreadyExists) {
  ShmObject shm(1 << 16);
  grpc::Status s = RegisterShm("dup", shm.name(), 0, 0);
  ASSERT_TRUE(s.ok()) << Describe(s);
  s = RegisterShm("dup", shm.name(), 4096, 4096);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << Describe(s);
  s = RegisterCuda("dup", std::string(64, '\0'), 1024);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << Describe(s);
  v1::ListRegionsResponse list;
  s = List(&list);
  ASSERT_TRUE(s.ok()) << Describe(s);
  ASSERT_EQ(list.regions_size(), 1);
  EXPECT_EQ(list.regions(0).name(), "dup");
  EXPECT_EQ(list.regions(0).shm_offset(), 0u);
  EXPECT_EQ(list.regions(0).byte_size(), 1u << 16);
}

TEST_F(RegionServiceTest, UnknownRegionIsNotFoundAndWritesNothing) {
  grpc::Status s = Unregister("nope");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(s);
  s = Append({RegionMessage("s", 0, 4, DType::kBFloat16, {0}, Ref("nope", 0), Ref("nope", 0))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(s);
  EXPECT_NE(s.error_message().find("'nope'"), std::string::npos) << Describe(s);
  s = RegisterShm("r", "/mlakv-region-test-does-not-exist", 0, 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(s);
  EXPECT_EQ(GetPool().pages_used(), 0u);
  v1::Sequence seq;
  EXPECT_EQ(GetSequence("s", &seq).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(RegionServiceTest, OutOfRangeRegistrationsAndRefs) {
  const uint64_t size = 4 * (kCkvRow + kKpeRow);
  ShmObject shm(size);
  grpc::Status s = RegisterShm("r", shm.name(), 0, size + 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  s = RegisterShm("r", shm.name(), 100, size - 99);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  s = RegisterShm("r", shm.name(), size, 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  s = RegisterShm("r", shm.name(), 0, 0);
  ASSERT_TRUE(s.ok()) << Describe(s);
  // 4 rows fit: ckv at 0, kpe at 4 x 1024. One byte further does not.
  s = Append({RegionMessage("s", 0, 4, DType::kBFloat16, {0}, Ref("r", 0), Ref("r", 4 * kCkvRow + 1))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  s = Append({RegionMessage("s", 0, 5, DType::kBFloat16, {0}, Ref("r", 0), Ref("r", 4 * kCkvRow))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  s = Append({RegionMessage("s", 0, 2, DType::kBFloat16, {0}, Ref("r", 0, 4 * kCkvRow), Ref("r", 4 * kCkvRow))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  s = Append({RegionMessage("s", 0, 1, DType::kBFloat16, {0}, Ref("r", UINT64_MAX), Ref("r", 0))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE) << Describe(s);
  EXPECT_EQ(GetPool().pages_used(), 0u);
  s = Append({RegionMessage("s", 0, 4, DType::kBFloat16, {0}, Ref("r", 0), Ref("r", 4 * kCkvRow))});
  EXPECT_TRUE(s.ok()) << Describe(s);
}

TEST_F(RegionServiceTest, MalformedRequestsAreInvalidArgument) {
  ShmObject shm(1 << 16);
  for (size_t bytes : {0, 63, 65, 128}) {
    grpc::Status s = RegisterCuda("c", std::string(bytes, '\x5a'), 1024);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bytes << ": " << Describe(s);
    EXPECT_NE(s.error_message().find("64"), std::string::npos) << Describe(s);
  }
  for (const std::string& bad : {std::string(""), std::string("no-slash"), std::string("/a/b"), std::string("/")}) {
    grpc::Status s = RegisterShm("r", bad, 0, 0);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << "'" << bad << "': " << Describe(s);
  }
  grpc::Status s = RegisterShm("", shm.name(), 0, 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  s = RegisterShm("r", shm.name(), 0, 0);
  ASSERT_TRUE(s.ok()) << Describe(s);
  // Stride below a row, odd stride.
  s = Append({RegionMessage("s", 0, 2, DType::kBFloat16, {0}, Ref("r", 0, kCkvRow - 2), Ref("r", 8192))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  s = Append({RegionMessage("s", 0, 2, DType::kBFloat16, {0}, Ref("r", 0), Ref("r", 8192, kKpeRow + 1))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  // Bytes and a ref for the same tensor.
  v1::AppendRequest both = RegionMessage("s", 0, 1, DType::kBFloat16, {0}, Ref("r", 0), Ref("r", 8192));
  both.mutable_layers(0)->set_ckv(std::string(kCkvRow, '\0'));
  s = Append({both});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  // dtype unset is still refused by the usual validation.
  v1::AppendRequest no_dtype = RegionMessage("s", 0, 1, DType::kBFloat16, {0}, Ref("r", 0), Ref("r", 8192));
  no_dtype.set_dtype(v1::ROW_DTYPE_UNSPECIFIED);
  s = Append({no_dtype});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(s);
  EXPECT_EQ(GetPool().pages_used(), 0u);
}

TEST_F(RegionServiceTest, ShrunkObjectIsFailedPreconditionNotACrash) {
  const Rows rows = RandomRows(8, 15);
  ShmObject shm(8 * (kCkvRow + kKpeRow));
  std::memcpy(shm.data(), rows.ckv.data(), 8 * kCkvRow);
  std::memcpy(shm.data() + 8 * kCkvRow, rows.kpe.data(), 8 * kKpeRow);
  grpc::Status s = RegisterShm("shrinks", shm.name(), 0, 0);
  ASSERT_TRUE(s.ok()) << Describe(s);
  // The producer shrinks its object; reading the old extent would fault (SIGBUS).
  const int fd = shm_open(shm.name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(ftruncate(fd, 4096), 0) << std::strerror(errno);
  close(fd);
  s = Append({RegionMessage("s", 0, 8, rows.dtype, {0}, Ref("shrinks", 0), Ref("shrinks", 8 * kCkvRow))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
  EXPECT_NE(s.error_message().find("shrank"), std::string::npos) << Describe(s);
  EXPECT_EQ(GetPool().pages_used(), 0u);
  s = AppendRows("still-serving", 0, rows, {0}, kCkvScale, kKpeScale);
  EXPECT_TRUE(s.ok()) << Describe(s);
}

TEST_F(RegionServiceTest, ExportPoolNeedsACudaPoolAndAllowIpc) {
  v1::ExportPoolRequest req;
  v1::ExportPoolResponse resp;
  {
    grpc::ClientContext ctx;
    grpc::Status s = stub().ExportPool(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(s);
    EXPECT_NE(s.error_message().find("cpu"), std::string::npos) << Describe(s);
  }
  {
    req.set_pool("nope");
    grpc::ClientContext ctx;
    grpc::Status s = stub().ExportPool(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(s);
  }
  StopServer();
  Start(false);
  req.set_pool("");
  grpc::ClientContext ctx;
  grpc::Status s = stub().ExportPool(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << Describe(s);
}

TEST_F(RegionServiceTest, UnregisterWhileAnAppendHoldsTheRegion) {
  const Rows rows = RandomRows(40, 14);
  const uint64_t kpe_off = 20 * kCkvRow;
  auto shm = std::make_unique<ShmObject>(20 * (kCkvRow + kKpeRow));
  std::memcpy(shm->data(), rows.ckv.data(), 20 * kCkvRow);
  std::memcpy(shm->data() + kpe_off, rows.kpe.data(), 20 * kKpeRow);
  grpc::Status s = RegisterShm("held", shm->name(), 0, 0);
  ASSERT_TRUE(s.ok()) << Describe(s);

  // Stream: message 1 reads rows [0, 20) from the region; the stream stays open.
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> writer = stub().Append(&ctx, &resp);
  ASSERT_TRUE(writer->Write(RegionMessage("seq", 0, 20, rows.dtype, {0}, Ref("held", 0), Ref("held", kpe_off))));
  // Wait (bounded) until the server has processed it and holds the region.
  bool held = false;
  for (int i = 0; i < 500 && !held; ++i) {
    v1::ListRegionsResponse list;
    s = List(&list);
    ASSERT_TRUE(s.ok()) << Describe(s);
    held = list.regions_size() == 1 && list.regions(0).appends_in_flight() == 1;
    if (!held) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(held) << "the open stream never showed up as holding the region";

  v1::UnregisterRegionResponse unreg;
  s = Unregister("held", &unreg);
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(unreg.appends_in_flight(), 1u);
  v1::ListRegionsResponse list;
  ASSERT_TRUE(List(&list).ok());
  EXPECT_EQ(list.regions_size(), 0);
  // The producer removes its object; the server's mapping (held by the stream) stays valid.
  shm.reset();

  // Another append naming it now: NOT_FOUND, nothing written.
  s = Append({RegionMessage("other", 0, 20, rows.dtype, {0}, Ref("held", 0), Ref("held", kpe_off))});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(s);

  // The held stream goes on with bytes and commits.
  ASSERT_TRUE(writer->Write(AppendMessage("", 20, rows, 20, 20, {0}, kCkvScale, kKpeScale)));
  writer->WritesDone();
  s = writer->Finish();
  ASSERT_TRUE(s.ok()) << Describe(s);
  EXPECT_EQ(resp.sequence().length(), 0u);  // only layer 0 written; length is the min over layers
  EXPECT_EQ(resp.sequence().layer_lengths(0), 40u);

  s = AppendRows("bytes", 0, rows, {0}, kCkvScale, kKpeScale);
  ASSERT_TRUE(s.ok()) << Describe(s);
  ExpectSameStored("seq", "bytes", {0}, rows.n);
  // The name is free again.
  ShmObject again(1 << 12);
  s = RegisterShm("held", again.name(), 0, 0);
  EXPECT_TRUE(s.ok()) << Describe(s);
}

}  // namespace
}  // namespace mlakv::server::testing
