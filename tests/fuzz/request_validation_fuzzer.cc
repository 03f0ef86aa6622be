// libFuzzer target: request validation of the service. The input is split
// into protobuf messages for one of the calls that change or read a pool
// (AppendBatch, an Append stream of up to four messages, one committed by
// CommitAppend, ReadSequence, TruncateSequence, FreeSequence, GetPage,
// leases, forks, MatchPrefix, GetSequence), sent to a server in this process
// (cpu backend). Whatever comes: the server answers, the pool's invariants
// hold, and a call that fails leaves the pool exactly as it was (pages,
// sequences, tokens per layer). Inputs that do not parse as the request type
// are skipped (the raw Append path is covered by tests/faults/).
//
// The calls go over loopback TCP, as clients reach mlakv-server, not over
// gRPC's in-process transport: in gRPC 1.51 that kept ~65 KB of every Append
// stream the server failed before the client's half-close while another
// call ran (a stream refused at its first message, then CommitAppend), and
// 11 minutes of fuzzing (3.5M inputs) grew past the 2 GB RSS limit -- with
// the server's own calls all deleted (counted), and the same inputs over TCP
// holding steady and running as fast.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <thread>
#include <string>
#include <vector>

#include "google/protobuf/text_format.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"
#include "server/rpc/kv_cache_server.h"
#include "spdlog/spdlog.h"

namespace {

using namespace mlakv;  // NOLINT

struct Fixture {
  std::unique_ptr<server::KvCacheServer> server;
  std::unique_ptr<v1::KvCache::Stub> stub;

  Fixture() {
    spdlog::set_level(spdlog::level::off);
    server::KvCacheServer::Options options;
    google::protobuf::TextFormat::ParseFromString(
        "pools { name: 'default' num_layers: 3 page_size: 4 num_pages: 64 max_sequences: 16 "
        "layer_scales { layer: 0 ckv_scale: 0.5 kpe_scale: 0.25 } } max_message_bytes: 1048576",
        &options.config);
    options.default_device = "cpu";
    options.listen = "127.0.0.1:0";
    auto created = server::KvCacheServer::Create(options);
    if (!created.ok()) {
      std::fprintf(stderr, "cannot start the server: %s\n", created.status().ToString().c_str());
      std::abort();
    }
    server = std::move(*created);
    stub = v1::KvCache::NewStub(grpc::CreateChannel(server->bound_address(), grpc::InsecureChannelCredentials()));
  }
};

Fixture& Get() {
  static Fixture* f = new Fixture();
  return *f;
}

struct State {
  int32_t pages_used;
  uint32_t sequences;
  std::vector<uint64_t> tokens;
  bool operator==(const State& o) const {
    return pages_used == o.pages_used && sequences == o.sequences && tokens == o.tokens;
  }
};

State Observe(server::Pool& pool) {
  const server::PoolSnapshot p = pool.Snapshot();
  State s{p.pages_used, p.sequences, {}};
  for (const auto& l : p.layers) s.tokens.push_back(l.tokens);
  return s;
}

[[noreturn]] void Violation(const std::string& what) {
  std::fprintf(stderr, "request validation violation: %s\n", what.c_str());
  std::abort();
}

// The input after the first byte, split at 0xff 0xfe 0xfd markers.
std::vector<std::string> Parts(const uint8_t* data, size_t size) {
  std::vector<std::string> parts(1);
  for (size_t i = 0; i < size; ++i) {
    if (i + 2 < size && data[i] == 0xff && data[i + 1] == 0xfe && data[i + 2] == 0xfd) {
      parts.emplace_back();
      i += 2;
      continue;
    }
    parts.back().push_back(static_cast<char>(data[i]));
  }
  return parts;
}

grpc::Status CallAppend(v1::KvCache::Stub& stub, const std::vector<std::string>& parts, bool* parsed) {
  std::vector<v1::AppendRequest> messages;
  for (size_t i = 0; i < parts.size() && i < 4; ++i) {
    v1::AppendRequest m;
    if (!m.ParseFromString(parts[i])) {
      *parsed = false;
      return grpc::Status::OK;
    }
    messages.push_back(std::move(m));
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::AppendResponse resp;
  auto writer = stub.Append(&ctx, &resp);
  for (const auto& m : messages) {
    if (!writer->Write(m)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

// An Append stream of up to three messages (all parts but the last) that
// CommitAppend (the last part, its token taken from the first message when
// it names none) commits -- or fails to -- while the stream is open; then
// its half-close. The stream's status is what the pool must agree with; a
// commit answered OK must have committed the stream.
grpc::Status CallCommitAppend(v1::KvCache::Stub& stub, const std::vector<std::string>& parts, bool* parsed) {
  v1::CommitAppendRequest commit;
  if (parts.size() < 2 || !commit.ParseFromString(parts.back())) {
    *parsed = false;
    return grpc::Status::OK;
  }
  std::vector<v1::AppendRequest> messages;
  for (size_t i = 0; i + 1 < parts.size() && i < 3; ++i) {
    if (!messages.emplace_back().ParseFromString(parts[i])) {
      *parsed = false;
      return grpc::Status::OK;
    }
  }
  if (commit.commit_token().empty()) commit.set_commit_token(messages.front().commit_token());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::AppendResponse resp, committed;
  auto writer = stub.Append(&ctx, &resp);
  for (const auto& m : messages) {
    if (!writer->Write(m)) break;
  }
  std::future<grpc::Status> call = std::async(std::launch::async, [&] {
    grpc::ClientContext commit_ctx;
    commit_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return stub.CommitAppend(&commit_ctx, commit, &committed);
  });
  // Let the commit arrive first, most of the time.
  std::this_thread::sleep_for(std::chrono::milliseconds(1));
  writer->WritesDone();
  const grpc::Status end = writer->Finish();
  const grpc::Status by_call = call.get();
  // A message that came after the commit ran (docs/reliability.md, "A stream
  // committed by CommitAppend"): the commit of the messages the call named
  // stands, the stream says the rest was not written. Only when the client
  // did send more messages than it named.
  const bool after_commit = by_call.ok() && end.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
                            end.error_message().find("was not written (the commit") != std::string::npos;
  if (after_commit && messages.size() <= commit.messages()) {
    Violation("the stream reports a message after the commit, but the client sent only the messages it named: " +
              end.error_message());
  }
  if (by_call.ok() && !end.ok() && !after_commit) {
    Violation("CommitAppend answered OK but its stream ended " + end.error_message());
  }
  if (by_call.ok() && end.ok() && committed.SerializeAsString() != resp.SerializeAsString()) {
    Violation("CommitAppend and its stream answered differently");
  }
  if (by_call.error_code() == grpc::StatusCode::INTERNAL || by_call.error_code() == grpc::StatusCode::UNKNOWN) {
    Violation("INTERNAL/UNKNOWN from CommitAppend: " + by_call.error_message());
  }
  return after_commit ? by_call : end;  // the commit stands: the pool changed as an OK append changes it
}

template <typename Request, typename Response, typename Method>
grpc::Status CallUnary(v1::KvCache::Stub& stub, Method method, const std::string& bytes, bool* parsed) {
  Request req;
  if (!req.ParseFromString(bytes)) {
    *parsed = false;
    return grpc::Status::OK;
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  Response resp;
  return (stub.*method)(&ctx, req, &resp);
}

grpc::Status CallRead(v1::KvCache::Stub& stub, const std::string& bytes, bool* parsed) {
  v1::ReadSequenceRequest req;
  if (!req.ParseFromString(bytes)) {
    *parsed = false;
    return grpc::Status::OK;
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto reader = stub.ReadSequence(&ctx, req);
  v1::ReadSequenceResponse resp;
  uint64_t bytes_read = 0;
  while (reader->Read(&resp)) bytes_read += resp.ByteSizeLong();
  if (bytes_read > (64u << 20)) Violation("ReadSequence returned more than the whole pool holds");
  return reader->Finish();
}

void FreeEverything(Fixture& f) {
  server::Pool& pool = *f.server->pools().front();
  for (const auto& l : pool.ListLeases(1000, 0).leases) static_cast<void>(pool.ReleaseLease(l.id));
  for (const auto& e : pool.ListSequences(1000, "").sequences) static_cast<void>(pool.FreeSequence(e.id));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  Fixture& f = Get();
  server::Pool& pool = *f.server->pools().front();
  const std::vector<std::string> parts = Parts(data + 1, size - 1);
  const State before = Observe(pool);
  bool parsed = true;
  grpc::Status status;
  bool mutates = true;
  switch (data[0] % 13) {
    case 0:
      status = CallUnary<v1::AppendBatchRequest, v1::AppendBatchResponse>(*f.stub, &v1::KvCache::Stub::AppendBatch,
                                                                           parts[0], &parsed);
      break;
    case 1: status = CallAppend(*f.stub, parts, &parsed); break;
    case 2:
      status = CallRead(*f.stub, parts[0], &parsed);
      mutates = false;
      break;
    case 3:
      status = CallUnary<v1::TruncateSequenceRequest, v1::Sequence>(*f.stub, &v1::KvCache::Stub::TruncateSequence,
                                                                     parts[0], &parsed);
      break;
    case 4:
      status = CallUnary<v1::FreeSequenceRequest, v1::FreeSequenceResponse>(*f.stub, &v1::KvCache::Stub::FreeSequence,
                                                                             parts[0], &parsed);
      break;
    case 5:
      status = CallUnary<v1::GetPageRequest, v1::Page>(*f.stub, &v1::KvCache::Stub::GetPage, parts[0], &parsed);
      mutates = false;
      break;
    // Cache management: leases change no pool state the checks observe
    // (pages, sequences, tokens) unless a free retains a sequence, and a
    // fork may create one; each must still be refused cleanly when bad.
    case 6:
      status = CallUnary<v1::AcquireLeaseRequest, v1::Lease>(*f.stub, &v1::KvCache::Stub::AcquireLease, parts[0],
                                                             &parsed);
      mutates = false;
      break;
    case 7:
      status = CallUnary<v1::ForkSequenceRequest, v1::ForkSequenceResponse>(*f.stub, &v1::KvCache::Stub::ForkSequence,
                                                                             parts[0], &parsed);
      break;
    case 8:
      status = CallUnary<v1::MatchPrefixRequest, v1::MatchPrefixResponse>(*f.stub, &v1::KvCache::Stub::MatchPrefix,
                                                                           parts[0], &parsed);
      mutates = false;
      break;
    case 9:
      status = CallUnary<v1::GetSequenceRequest, v1::Sequence>(*f.stub, &v1::KvCache::Stub::GetSequence, parts[0],
                                                               &parsed);
      mutates = false;
      break;
    case 10:
      status = CallUnary<v1::RenewLeaseRequest, v1::Lease>(*f.stub, &v1::KvCache::Stub::RenewLease, parts[0], &parsed);
      mutates = false;
      break;
    case 11:
      status = CallUnary<v1::ReleaseLeaseRequest, v1::ReleaseLeaseResponse>(*f.stub, &v1::KvCache::Stub::ReleaseLease,
                                                                             parts[0], &parsed);
      break;
    case 12: status = CallCommitAppend(*f.stub, parts, &parsed); break;
  }
  if (!parsed) return 0;
  if (absl::Status inv = pool.CheckInvariants(); !inv.ok()) Violation(inv.ToString());
  const State after = Observe(pool);
  if ((!status.ok() || !mutates) && !(after == before)) {
    Violation("a call that failed or only reads changed the pool: " + status.error_message());
  }
  if (status.error_code() == grpc::StatusCode::INTERNAL || status.error_code() == grpc::StatusCode::UNKNOWN) {
    Violation("INTERNAL/UNKNOWN for client input: " + status.error_message());
  }
  if (after.sequences > 8 || pool.Snapshot().leases > 16) FreeEverything(f);  // keep the state small
  return 0;
}
