#include "server/cq/reflection_service.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/quote.h"
#include "server/cq/calls.h"

namespace mlakv::server::cq {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::FileDescriptor;
using grpc::reflection::v1::ServerReflectionRequest;
using grpc::reflection::v1::ServerReflectionResponse;

// grpc/reflection/v1alpha/reflection.proto declares a service and no
// message, so nothing the server calls lives in its generated .pb.cc, and a
// linker taking objects out of mlakv_proto's archive on demand leaves that
// object out -- and with it the static initializer that adds the file to
// the generated pool (file_containing_symbol of the v1alpha service would
// be NOT_FOUND). Its descriptor table is defined there: naming it links it.
[[gnu::used]] const void* const kLinkV1alphaFile = &::descriptor_table_grpc_2freflection_2fv1alpha_2freflection_2eproto;

// Client text quoted in an error: a name is short; a 4 MB one is cut.
constexpr size_t kQuoteBytes = 200;

void SetError(ServerReflectionResponse* response, grpc::StatusCode code, std::string message) {
  grpc::reflection::v1::ErrorResponse* error = response->mutable_error_response();
  error->set_error_code(code);
  error->set_error_message(std::move(message));
}

void AddSerialized(const FileDescriptor* file, grpc::reflection::v1::FileDescriptorResponse* files) {
  google::protobuf::FileDescriptorProto proto;
  file->CopyTo(&proto);
  files->add_file_descriptor_proto(proto.SerializeAsString());
}

}  // namespace

// One ServerReflectionInfo stream: read a request, write its answer, read
// the next. One operation in flight at a time, so the reactions follow one
// another and share the stream's state without a lock.
class ReflectionService::InfoCall final : public ReaderWriterCall<ReflectionRequest, ReflectionResponse> {
 public:
  InfoCall(const ReflectionService* service, QueueThreads* queue, const RequestFn* request)
      : ReaderWriterCall(queue), service_(service), request_(request) {}

 private:
  void Request(void* tag) override { (*request_)(&ctx_, stream(), tag); }
  Call* NextCall() override { return new InfoCall(service_, queue_, request_); }

  void OnStart() override { StartRead(&question_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // A half-close ends the stream well; a broken or cancelled call's
      // status reaches no one, but a Finish is owed all the same.
      Finish(context()->cancelled() ? grpc::Status::CANCELLED : grpc::Status::OK);
      return;
    }
    answer_.Clear();
    service_->Answer(question_, &sent_, &answer_);
    StartWrite(&answer_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::CANCELLED);  // the stream broke
      return;
    }
    StartRead(&question_);
  }

  const ReflectionService* const service_;
  const RequestFn* const request_;
  ReflectionRequest question_;
  ReflectionResponse answer_;
  absl::flat_hash_set<std::string> sent_;  // names of the files this stream sent
};

ReflectionService::ReflectionService(std::vector<std::string> services)
    : services_(std::move(services)), pool_(google::protobuf::DescriptorPool::generated_pool()) {}

ReflectionService::~ReflectionService() = default;

void ReflectionService::Serve(QueueThreads* queue) {
  grpc::ServerCompletionQueue* cq = queue->queue();
  request_v1_ = [this, cq](grpc::ServerContext* ctx, Stream* stream, void* tag) {
    v1_.RequestServerReflectionInfo(ctx, stream, cq, cq, tag);
  };
  request_v1alpha_ = [this, cq](grpc::ServerContext* ctx, Stream* stream, void* tag) {
    v1alpha_.RequestServerReflectionInfo(ctx, stream, cq, cq, tag);
  };
  Call::Arm(new InfoCall(this, queue, &request_v1_));
  Call::Arm(new InfoCall(this, queue, &request_v1alpha_));
}

void ReflectionService::Answer(const ReflectionRequest& request, absl::flat_hash_set<std::string>* sent,
                               ReflectionResponse* response) const {
  response->set_valid_host(request.host());
  *response->mutable_original_request() = request;
  switch (request.message_request_case()) {
    case ServerReflectionRequest::kFileByFilename: {
      const FileDescriptor* file = pool_->FindFileByName(request.file_by_filename());
      if (file == nullptr) {
        SetError(response, grpc::StatusCode::NOT_FOUND,
                 absl::StrCat("file ", Quote(request.file_by_filename(), kQuoteBytes), " not found"));
        return;
      }
      AnswerFile(file, sent, response);
      return;
    }
    case ServerReflectionRequest::kFileContainingSymbol: {
      // Services, methods, messages, fields, enums, enum values, extensions.
      const FileDescriptor* file = pool_->FindFileContainingSymbol(request.file_containing_symbol());
      if (file == nullptr) {
        SetError(response, grpc::StatusCode::NOT_FOUND,
                 absl::StrCat("symbol ", Quote(request.file_containing_symbol(), kQuoteBytes), " not found"));
        return;
      }
      AnswerFile(file, sent, response);
      return;
    }
    case ServerReflectionRequest::kFileContainingExtension: {
      const grpc::reflection::v1::ExtensionRequest& ext = request.file_containing_extension();
      const Descriptor* type = pool_->FindMessageTypeByName(ext.containing_type());
      if (type == nullptr) {
        SetError(response, grpc::StatusCode::NOT_FOUND,
                 absl::StrCat("message type ", Quote(ext.containing_type(), kQuoteBytes), " not found"));
        return;
      }
      const FieldDescriptor* field = pool_->FindExtensionByNumber(type, ext.extension_number());
      if (field == nullptr) {
        SetError(response, grpc::StatusCode::NOT_FOUND,
                 absl::StrCat("extension ", ext.extension_number(), " of ", type->full_name(), " not found"));
        return;
      }
      AnswerFile(field->file(), sent, response);
      return;
    }
    case ServerReflectionRequest::kAllExtensionNumbersOfType: {
      const Descriptor* type = pool_->FindMessageTypeByName(request.all_extension_numbers_of_type());
      if (type == nullptr) {
        SetError(response, grpc::StatusCode::NOT_FOUND,
                 absl::StrCat("message type ", Quote(request.all_extension_numbers_of_type(), kQuoteBytes),
                              " not found"));
        return;
      }
      std::vector<const FieldDescriptor*> extensions;
      pool_->FindAllExtensions(type, &extensions);  // the generated files' too, not only those loaded
      std::vector<int> numbers;
      numbers.reserve(extensions.size());
      for (const FieldDescriptor* e : extensions) numbers.push_back(e->number());
      std::sort(numbers.begin(), numbers.end());
      grpc::reflection::v1::ExtensionNumberResponse* out = response->mutable_all_extension_numbers_response();
      out->set_base_type_name(type->full_name());
      for (int n : numbers) out->add_extension_number(n);
      return;
    }
    case ServerReflectionRequest::kListServices: {
      grpc::reflection::v1::ListServiceResponse* out = response->mutable_list_services_response();
      for (const std::string& name : services_) out->add_service()->set_name(name);
      return;
    }
    case ServerReflectionRequest::MESSAGE_REQUEST_NOT_SET:
      break;
  }
  SetError(response, grpc::StatusCode::INVALID_ARGUMENT,
           "the request asks nothing (none of file_by_filename, file_containing_symbol, file_containing_extension, "
           "all_extension_numbers_of_type, list_services)");
}

void ReflectionService::AnswerFile(const FileDescriptor* file, absl::flat_hash_set<std::string>* sent,
                                   ReflectionResponse* response) const {
  grpc::reflection::v1::FileDescriptorResponse* files = response->mutable_file_descriptor_response();
  // The file asked for is always sent, first, even when the stream sent it
  // before: the answer must name it. Its imports only once per stream: a
  // file goes out with every import not sent yet, so a file already sent
  // has all its imports on the client, and the walk stops there.
  AddSerialized(file, files);
  sent->insert(file->name());
  std::vector<const FileDescriptor*> walk = {file};
  while (!walk.empty()) {
    const FileDescriptor* f = walk.back();
    walk.pop_back();
    for (int i = 0; i < f->dependency_count(); ++i) {
      const FileDescriptor* dep = f->dependency(i);  // null: a weak import not linked in
      if (dep == nullptr || !sent->insert(dep->name()).second) continue;
      AddSerialized(dep, files);
      walk.push_back(dep);
    }
  }
}

}  // namespace mlakv::server::cq
