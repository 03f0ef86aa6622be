// ReflectionService over a real server on loopback, asked through the
// generated v1 and v1alpha stubs: list_services, file_containing_symbol for
// every kind of symbol, files sent with their imports once per stream,
// extensions (from reflection_test_extensions.proto, linked in here),
// NOT_FOUND with a bounded message, INVALID_ARGUMENT for an empty question,
// many questions answered in order, and the stream's ends: half-close,
// the client's cancel, the server's shutdown.
#include "server/cq/reflection_service.h"

#include <google/protobuf/descriptor.pb.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "server/cq/health_service.h"
#include "tests/server/cq/cq_test_server.h"

namespace mlakv::server::cq {
namespace {

using google::protobuf::FileDescriptorProto;
using grpc::reflection::v1::ServerReflectionRequest;
using grpc::reflection::v1::ServerReflectionResponse;

constexpr char kHealthFile[] = "grpc/health/v1/health.proto";
constexpr char kV1File[] = "grpc/reflection/v1/reflection.proto";
constexpr char kV1alphaFile[] = "grpc/reflection/v1alpha/reflection.proto";
constexpr char kExtensionsFile[] = "reflection_test_extensions.proto";
constexpr char kDescriptorFile[] = "google/protobuf/descriptor.proto";
constexpr char kExtendable[] = "mlakv.test.reflection.Extendable";

// Check, Watch and the two ServerReflectionInfo are waiting for a call.
constexpr int kArmedCalls = 4;

ServerReflectionRequest Symbol(const std::string& symbol) {
  ServerReflectionRequest r;
  r.set_file_containing_symbol(symbol);
  return r;
}
ServerReflectionRequest File(const std::string& name) {
  ServerReflectionRequest r;
  r.set_file_by_filename(name);
  return r;
}
ServerReflectionRequest Extension(const std::string& type, int number) {
  ServerReflectionRequest r;
  r.mutable_file_containing_extension()->set_containing_type(type);
  r.mutable_file_containing_extension()->set_extension_number(number);
  return r;
}
ServerReflectionRequest AllExtensions(const std::string& type) {
  ServerReflectionRequest r;
  r.set_all_extension_numbers_of_type(type);
  return r;
}
ServerReflectionRequest List() {
  ServerReflectionRequest r;
  r.set_list_services("");
  return r;
}

std::vector<FileDescriptorProto> Files(const ServerReflectionResponse& r) {
  std::vector<FileDescriptorProto> files;
  for (const std::string& bytes : r.file_descriptor_response().file_descriptor_proto()) {
    files.emplace_back();
    EXPECT_TRUE(files.back().ParseFromString(bytes));
  }
  return files;
}

std::vector<std::string> FileNames(const ServerReflectionResponse& r) {
  std::vector<std::string> names;
  for (const FileDescriptorProto& f : Files(r)) names.push_back(f.name());
  return names;
}

// One ServerReflectionInfo stream, of either version.
struct Stream {
  explicit Stream(grpc::reflection::v1::ServerReflection::Stub* stub) {
    SetDeadline();
    rw = stub->ServerReflectionInfo(&ctx);
  }
  explicit Stream(grpc::reflection::v1alpha::ServerReflection::Stub* stub) {
    SetDeadline();
    rw = stub->ServerReflectionInfo(&ctx);
  }
  void SetDeadline() { ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30)); }

  ServerReflectionResponse Ask(const ServerReflectionRequest& request) {
    ServerReflectionResponse response;
    EXPECT_TRUE(rw->Write(request));
    EXPECT_TRUE(rw->Read(&response));
    EXPECT_EQ(response.original_request().SerializeAsString(), request.SerializeAsString());
    return response;
  }
  // Half-closes; the server ends the stream.
  grpc::Status Close() {
    EXPECT_TRUE(rw->WritesDone());
    ServerReflectionResponse extra;
    EXPECT_FALSE(rw->Read(&extra));
    return rw->Finish();
  }

  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<ServerReflectionRequest, ServerReflectionResponse>> rw;
};

class ReflectionServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<testing::CqTestServer>(
        std::vector<grpc::Service*>{health_.service(), reflection_.v1_service(), reflection_.v1alpha_service()}, 2);
    ASSERT_TRUE(server_->started());
    health_.Serve(server_->threads());
    reflection_.Serve(server_->threads());
    v1_ = grpc::reflection::v1::ServerReflection::NewStub(server_->channel());
    v1alpha_ = grpc::reflection::v1alpha::ServerReflection::NewStub(server_->channel());
  }

  void TearDown() override {
    server_->Stop();
    EXPECT_EQ(server_->threads()->calls_alive(), 0);
  }

  bool CallsAliveReach(int count) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (server_->threads()->calls_alive() != count) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return true;
  }

  // Listed as given, one of them served by no one.
  const std::vector<std::string> services_ = {"grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                                              "grpc.reflection.v1alpha.ServerReflection", "mlakv.test.Listed"};
  HealthService health_{{}};
  ReflectionService reflection_{services_};
  std::unique_ptr<testing::CqTestServer> server_;
  std::unique_ptr<grpc::reflection::v1::ServerReflection::Stub> v1_;
  std::unique_ptr<grpc::reflection::v1alpha::ServerReflection::Stub> v1alpha_;
};

TEST_F(ReflectionServiceTest, ListServicesNamesExactlyTheServicesGiven) {
  for (Stream* s : {new Stream(v1_.get()), new Stream(v1alpha_.get())}) {
    std::unique_ptr<Stream> stream(s);
    ServerReflectionRequest request = List();
    request.set_host("cache.example:50051");
    const ServerReflectionResponse response = stream->Ask(request);
    EXPECT_EQ(response.valid_host(), "cache.example:50051");
    std::vector<std::string> names;
    for (const auto& service : response.list_services_response().service()) names.push_back(service.name());
    EXPECT_EQ(names, services_);
    EXPECT_TRUE(stream->Close().ok());
  }
}

TEST_F(ReflectionServiceTest, FileContainingSymbolFindsEveryKindOfSymbol) {
  Stream stream(v1_.get());
  const ServerReflectionResponse response = stream.Ask(Symbol("grpc.health.v1.Health"));
  const std::vector<FileDescriptorProto> files = Files(response);
  ASSERT_EQ(files.size(), 1u);  // health.proto imports nothing
  EXPECT_EQ(files[0].name(), kHealthFile);
  EXPECT_EQ(files[0].package(), "grpc.health.v1");
  ASSERT_EQ(files[0].service_size(), 1);
  EXPECT_EQ(files[0].service(0).name(), "Health");
  ASSERT_EQ(files[0].service(0).method_size(), 2);
  EXPECT_EQ(files[0].service(0).method(1).name(), "Watch");
  EXPECT_TRUE(files[0].service(0).method(1).server_streaming());

  for (const char* symbol : {"grpc.health.v1.Health.Check", "grpc.health.v1.HealthCheckRequest",
                             "grpc.health.v1.HealthCheckRequest.service", "grpc.health.v1.HealthCheckResponse.ServingStatus",
                             "grpc.health.v1.HealthCheckResponse.SERVICE_UNKNOWN"}) {
    EXPECT_EQ(FileNames(stream.Ask(Symbol(symbol))), std::vector<std::string>{kHealthFile}) << symbol;
  }
  EXPECT_TRUE(stream.Close().ok());
}

TEST_F(ReflectionServiceTest, AFileGoesWithTheImportsTheStreamHasNotSent) {
  Stream stream(v1_.get());
  // v1alpha's service is declared on v1's messages: its file comes first,
  // with the one it imports.
  const ServerReflectionResponse first = stream.Ask(Symbol("grpc.reflection.v1alpha.ServerReflection"));
  ASSERT_EQ(FileNames(first), (std::vector<std::string>{kV1alphaFile, kV1File})) << first.DebugString();
  EXPECT_EQ(Files(first)[0].dependency(0), kV1File);
  // Asked again, or its import asked for: the file alone.
  EXPECT_EQ(FileNames(stream.Ask(Symbol("grpc.reflection.v1alpha.ServerReflection.ServerReflectionInfo"))),
            std::vector<std::string>{kV1alphaFile});
  EXPECT_EQ(FileNames(stream.Ask(File(kV1File))), std::vector<std::string>{kV1File});
  EXPECT_TRUE(stream.Close().ok());

  // Another stream (of the other version) starts afresh.
  Stream other(v1alpha_.get());
  EXPECT_EQ(FileNames(other.Ask(File(kV1alphaFile))), (std::vector<std::string>{kV1alphaFile, kV1File}));
  EXPECT_TRUE(other.Close().ok());
}

TEST_F(ReflectionServiceTest, ExtensionsOfAMessageType) {
  Stream stream(v1_.get());
  const ServerReflectionResponse file = stream.Ask(Extension(kExtendable, 150));
  ASSERT_EQ(FileNames(file), (std::vector<std::string>{kExtensionsFile, kDescriptorFile})) << file.DebugString();
  const std::vector<FileDescriptorProto> files = Files(file);
  bool found = false;
  for (const auto& e : files[0].extension()) found |= e.name() == "second" && e.number() == 150;
  EXPECT_TRUE(found);

  const ServerReflectionResponse numbers = stream.Ask(AllExtensions(kExtendable));
  EXPECT_EQ(numbers.all_extension_numbers_response().base_type_name(), kExtendable);
  EXPECT_EQ(std::vector<int>(numbers.all_extension_numbers_response().extension_number().begin(),
                             numbers.all_extension_numbers_response().extension_number().end()),
            (std::vector<int>{100, 150}));

  // An extension of a type from another file: that file is on the client.
  EXPECT_EQ(FileNames(stream.Ask(Extension("google.protobuf.MessageOptions", 51234))),
            std::vector<std::string>{kExtensionsFile});
  const ServerReflectionResponse options = stream.Ask(AllExtensions("google.protobuf.MessageOptions"));
  const auto& option_numbers = options.all_extension_numbers_response().extension_number();
  EXPECT_NE(std::find(option_numbers.begin(), option_numbers.end(), 51234), option_numbers.end());
  EXPECT_TRUE(stream.Close().ok());
}

TEST_F(ReflectionServiceTest, UnknownNamesAreNotFoundAndTheStreamGoesOn) {
  Stream stream(v1_.get());
  struct Case {
    ServerReflectionRequest request;
    std::string named;
  };
  const std::vector<Case> cases = {
      {Symbol("no.such.Symbol"), "symbol 'no.such.Symbol'"},
      {File("no/such.proto"), "file 'no/such.proto'"},
      {Extension("no.such.Type", 100), "message type 'no.such.Type'"},
      {Extension(kExtendable, 199), "extension 199 of mlakv.test.reflection.Extendable"},
      {AllExtensions("no.such.Type"), "message type 'no.such.Type'"},
  };
  for (const Case& c : cases) {
    const ServerReflectionResponse response = stream.Ask(c.request);
    ASSERT_TRUE(response.has_error_response()) << c.named;
    EXPECT_EQ(response.error_response().error_code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
    EXPECT_EQ(response.error_response().error_message(), c.named + " not found");
  }
  // A huge name is quoted in part only.
  const ServerReflectionResponse huge = stream.Ask(Symbol(std::string(100000, 'x')));
  EXPECT_EQ(huge.error_response().error_code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
  EXPECT_LT(huge.error_response().error_message().size(), 400u);
  EXPECT_EQ(FileNames(stream.Ask(Symbol("grpc.health.v1.Health"))), std::vector<std::string>{kHealthFile});
  EXPECT_TRUE(stream.Close().ok());
}

TEST_F(ReflectionServiceTest, ARequestThatAsksNothingIsInvalidArgument) {
  Stream stream(v1alpha_.get());
  ServerReflectionRequest empty;
  empty.set_host("h");
  const ServerReflectionResponse response = stream.Ask(empty);
  EXPECT_EQ(response.error_response().error_code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_EQ(response.valid_host(), "h");
  EXPECT_TRUE(stream.Close().ok());
}

TEST_F(ReflectionServiceTest, ManyRequestsOnOneStreamAreAnsweredInOrder) {
  constexpr int kRequests = 300;
  std::vector<ServerReflectionRequest> requests;
  for (int i = 0; i < kRequests; ++i) {
    switch (i % 5) {
      case 0: requests.push_back(List()); break;
      case 1: requests.push_back(Symbol("grpc.health.v1.HealthCheckResponse")); break;
      case 2: requests.push_back(File(kV1alphaFile)); break;
      case 3: requests.push_back(Symbol("no.such.Symbol" + std::to_string(i))); break;
      case 4: requests.push_back(AllExtensions(kExtendable)); break;
    }
    requests.back().set_host(std::to_string(i));
  }
  Stream stream(v1_.get());
  // The client writes everything before it reads, from another thread, as
  // a pipelining client does.
  std::thread writer([&] {
    for (const ServerReflectionRequest& r : requests) {
      if (!stream.rw->Write(r)) return;
    }
    stream.rw->WritesDone();
  });
  int answered = 0;
  ServerReflectionResponse response;
  while (stream.rw->Read(&response)) {
    ASSERT_LT(answered, kRequests);
    EXPECT_EQ(response.valid_host(), std::to_string(answered));
    EXPECT_EQ(response.original_request().SerializeAsString(), requests[answered].SerializeAsString());
    EXPECT_EQ(response.message_response_case() == ServerReflectionResponse::kErrorResponse, answered % 5 == 3);
    if (answered % 5 == 2) {
      // Imports once: the first time both files, then the file alone.
      EXPECT_EQ(Files(response).size(), answered == 2 ? 2u : 1u);
    }
    ++answered;
  }
  writer.join();
  EXPECT_EQ(answered, kRequests);
  EXPECT_TRUE(stream.rw->Finish().ok());
}

TEST_F(ReflectionServiceTest, HalfCloseAtOnceEndsTheStreamOk) {
  Stream stream(v1_.get());
  EXPECT_TRUE(stream.Close().ok());
  EXPECT_TRUE(CallsAliveReach(kArmedCalls));
}

TEST_F(ReflectionServiceTest, TheClientsCancelEndsTheStream) {
  {
    Stream stream(v1_.get());
    stream.Ask(List());
    stream.ctx.TryCancel();
    ServerReflectionResponse response;
    EXPECT_FALSE(stream.rw->Read(&response));
    EXPECT_EQ(stream.rw->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  {
    // Cancelled with questions in flight, answers unread.
    Stream stream(v1alpha_.get());
    for (int i = 0; i < 50; ++i) stream.rw->Write(File(kV1alphaFile));
    stream.ctx.TryCancel();
    EXPECT_EQ(stream.rw->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  EXPECT_TRUE(CallsAliveReach(kArmedCalls));
  Stream next(v1_.get());
  EXPECT_EQ(FileNames(next.Ask(File(kHealthFile))), std::vector<std::string>{kHealthFile});
  EXPECT_TRUE(next.Close().ok());
}

TEST_F(ReflectionServiceTest, TheServersShutdownEndsAnOpenStream) {
  Stream stream(v1_.get());
  stream.Ask(List());
  EXPECT_TRUE(CallsAliveReach(kArmedCalls + 1));
  server_->Stop();
  EXPECT_EQ(server_->threads()->calls_alive(), 0);
  ServerReflectionResponse response;
  EXPECT_FALSE(stream.rw->Read(&response));
  EXPECT_FALSE(stream.rw->Finish().ok());
}

}  // namespace
}  // namespace mlakv::server::cq
