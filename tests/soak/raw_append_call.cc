#include "tests/soak/raw_append_call.h"

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace mlakv::soak {
namespace {

// One operation at a time: start it with `tag`, then wait for it here.
bool Await(grpc::CompletionQueue& cq, void* tag) {
  void* got = nullptr;
  bool ok = false;
  while (cq.Next(&got, &ok)) {
    if (got == tag) return ok;
  }
  return false;
}

}  // namespace

RawAppendCall::Result RawAppendCall::Run(const std::shared_ptr<grpc::Channel>& channel,
                                         const std::vector<std::string>& messages, absl::Duration timeout) {
  Result result;
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      stub.PrepareCall(&context, "/mlakv.v1.KvCache/Append", &cq);
  int tag = 0;
  call->StartCall(&tag);
  bool alive = Await(cq, &tag);
  for (const std::string& m : messages) {
    if (!alive) break;
    grpc::Slice slice(m);
    grpc::ByteBuffer buffer(&slice, 1);
    call->Write(buffer, &tag);
    alive = Await(cq, &tag);
    if (alive) ++result.messages_written;
  }
  if (alive) {
    call->WritesDone(&tag);
    Await(cq, &tag);
  }
  // Read before Finish: the status comes after every message the server sent.
  grpc::ByteBuffer response;
  call->Read(&response, &tag);
  result.got_response = Await(cq, &tag);
  call->Finish(&result.status, &tag);
  Await(cq, &tag);
  cq.Shutdown();
  void* ignored_tag;
  bool ignored_ok;
  while (cq.Next(&ignored_tag, &ignored_ok)) {
  }
  return result;
}

}  // namespace mlakv::soak
