#include "tests/server/rpc/service_fixture.h"

#include "google/protobuf/text_format.h"

namespace mlakv::server::testing {

void ServiceFixture::StartServer(const std::string& device, const std::string& pool_text, const std::string& extra,
                                 const std::string& listen) {
  v1::ServerConfig config;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString("pools { " + pool_text + " } " + extra, &config))
      << pool_text;
  KvCacheServer::Options options;
  options.config = config;
  options.listen = listen;
  options.default_device = device;
  options.allow_ipc = allow_ipc_;
  options.server_id = "test-server";
  options.after_last_check_for_testing = after_last_check_;
  absl::StatusOr<std::unique_ptr<KvCacheServer>> server = KvCacheServer::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  server_ = std::move(*server);
  stub_ = v1::KvCache::NewStub(server_->InProcessChannel());
}

grpc::Status ServiceFixture::Append(const std::vector<v1::AppendRequest>& messages, v1::AppendResponse* resp) {
  grpc::ClientContext ctx;
  v1::AppendResponse local;
  std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> writer = stub_->Append(&ctx, resp ? resp : &local);
  for (const v1::AppendRequest& m : messages) {
    if (!writer->Write(m)) break;  // the server finished early (an error); Finish says why
  }
  writer->WritesDone();
  return writer->Finish();
}

void ServiceFixture::Free(const std::string& sequence) {
  grpc::ClientContext ctx;
  v1::FreeSequenceRequest req;
  req.set_sequence(sequence);
  v1::FreeSequenceResponse resp;
  const grpc::Status s = stub_->FreeSequence(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << sequence << ": " << Describe(s);
}

grpc::Status ServiceFixture::AppendRows(const std::string& sequence, uint32_t start, const Rows& rows,
                                        const std::vector<uint32_t>& layers, float ckv_scale, float kpe_scale,
                                        int64_t per_message, v1::AppendResponse* resp) {
  std::vector<v1::AppendRequest> messages;
  for (int64_t first = 0; first < rows.n || (rows.n == 0 && first == 0); first += per_message) {
    const int64_t count = std::min<int64_t>(per_message, rows.n - first);
    messages.push_back(AppendMessage(messages.empty() ? sequence : "", static_cast<uint32_t>(start + first), rows,
                                     first, count, layers, ckv_scale, kpe_scale));
    if (rows.n == 0) break;
  }
  return Append(messages, resp);
}

Stored ServiceFixture::Read(const std::string& sequence, uint32_t layer, uint32_t start, uint32_t count,
                            bool dequantize, uint32_t tokens_per_message, const std::string& pool) {
  Stored out;
  v1::ReadSequenceRequest req;
  req.set_pool(pool);
  req.set_sequence(sequence);
  req.add_layers(layer);
  req.set_start(start);
  req.set_count(count);
  req.set_format(dequantize ? v1::READ_FORMAT_DEQUANTIZED : v1::READ_FORMAT_RAW);
  req.set_tokens_per_message(tokens_per_message);
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::ReadSequenceResponse>> reader = stub_->ReadSequence(&ctx, req);
  v1::ReadSequenceResponse resp;
  uint32_t expect_start = start;
  while (reader->Read(&resp)) {
    ++out.messages;
    EXPECT_EQ(resp.layer(), layer);
    EXPECT_EQ(resp.start(), expect_start);
    expect_start += resp.count();
    out.rows.rows += resp.count();
    out.rows.ckv_packed.insert(out.rows.ckv_packed.end(), resp.ckv_packed().begin(), resp.ckv_packed().end());
    out.rows.ckv_sf.insert(out.rows.ckv_sf.end(), resp.ckv_sf().begin(), resp.ckv_sf().end());
    out.rows.kpe.insert(out.rows.kpe.end(), resp.kpe().begin(), resp.kpe().end());
    const size_t nc = out.ckv_float.size(), nk = out.kpe_float.size();
    out.ckv_float.resize(nc + resp.ckv_float().size() / 4);
    out.kpe_float.resize(nk + resp.kpe_float().size() / 4);
    // Raw reads carry no floats: memcpy from or to a null pointer is undefined
    // even for 0 bytes (UBSan: invalid-null-argument), and an empty vector's
    // data() may be null.
    if (!resp.ckv_float().empty()) {
      std::memcpy(out.ckv_float.data() + nc, resp.ckv_float().data(), resp.ckv_float().size());
    }
    if (!resp.kpe_float().empty()) {
      std::memcpy(out.kpe_float.data() + nk, resp.kpe_float().data(), resp.kpe_float().size());
    }
    out.ckv_scale = resp.ckv_scale();
    out.kpe_scale = resp.kpe_scale();
  }
  out.status = reader->Finish();
  return out;
}

std::unique_ptr<absl::Notification> ServiceFixture::BlockWorker() {
  auto release = std::make_unique<absl::Notification>();
  absl::Notification* r = release.get();
  absl::Notification started;
  pool().worker().Post([r, &started] {
    started.Notify();
    r->WaitForNotification();
  });
  started.WaitForNotification();
  return release;
}

v1::Pool ServiceFixture::GetPool() {
  grpc::ClientContext ctx;
  v1::Pool pool;
  grpc::Status s = stub_->GetPool(&ctx, v1::GetPoolRequest(), &pool);
  EXPECT_TRUE(s.ok()) << Describe(s);
  return pool;
}

grpc::Status ServiceFixture::GetSequence(const std::string& id, v1::Sequence* out) {
  grpc::ClientContext ctx;
  v1::GetSequenceRequest req;
  req.set_sequence(id);
  return stub_->GetSequence(&ctx, req, out);
}

grpc::Status ServiceFixture::Unregister(const std::string& name, v1::UnregisterRegionResponse* out) {
  v1::UnregisterRegionRequest req;
  req.set_name(name);
  v1::UnregisterRegionResponse local;
  grpc::ClientContext ctx;
  return stub_->UnregisterRegion(&ctx, req, out ? out : &local);
}

void ServiceFixture::ExpectSameStored(const std::string& a, const std::string& b, const std::vector<uint32_t>& layers,
                                      uint32_t count, const std::string& pool_a, const std::string& pool_b) {
  for (uint32_t l : layers) {
    Stored sa = Read(a, l, 0, count, false, 0, pool_a);
    Stored sb = Read(b, l, 0, count, false, 0, pool_b);
    const std::string where = pool_a + "/" + a + " vs " + pool_b + "/" + b + " layer " + std::to_string(l);
    ASSERT_TRUE(sa.status.ok()) << where << ": " << Describe(sa.status);
    ASSERT_TRUE(sb.status.ok()) << where << ": " << Describe(sb.status);
    EXPECT_EQ(sa.rows.rows, count) << where;
    EXPECT_EQ(sa.rows.ckv_packed, sb.rows.ckv_packed) << where;
    EXPECT_EQ(sa.rows.ckv_sf, sb.rows.ckv_sf) << where;
    EXPECT_EQ(sa.rows.kpe, sb.rows.kpe) << where;
  }
}

}  // namespace mlakv::server::testing
