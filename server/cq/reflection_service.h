// ReflectionService: server reflection, grpc.reflection.v1 and v1alpha
// (ServerReflectionInfo, a bidirectional stream), on a QueueThreads.
//
// libgrpc++_reflection serves it as a synchronous-API service, whose
// threads poll beside the queue's own (cq/queue_threads.h); this one runs on
// the server's completion queue. Clients (grpcurl, buf curl, Postman) speak
// v1 or still only v1alpha; both names are served from the same messages.
//
// Each request gets one response, in order; one read, then one write, at a
// time. Descriptors come from the process's generated pool, so reflection
// describes every proto linked into the server; list_services says only
// the names given to the constructor. A file is sent with those of its
// transitive imports that this stream has not sent yet, as the protocol
// asks: a client builds its pool from what the stream sent.
//
//   ReflectionService reflection({"mlakv.v1.KvCache", "grpc.health.v1.Health",
//                                 "grpc.reflection.v1.ServerReflection",
//                                 "grpc.reflection.v1alpha.ServerReflection"});
//   builder.RegisterService(reflection.v1_service());
//   builder.RegisterService(reflection.v1alpha_service());
//   ... BuildAndStart, QueueThreads::Start ...
//   reflection.Serve(&threads);
//
// The service outlives the QueueThreads' Shutdown (its calls point at it).
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "server/cq/queue_threads.h"

namespace google::protobuf {
class DescriptorPool;
class FileDescriptor;
}  // namespace google::protobuf

namespace mlakv::server::cq {

class ReflectionService {
 public:
  // `services`: the fully qualified names list_services answers, as given.
  explicit ReflectionService(std::vector<std::string> services);
  ~ReflectionService();
  ReflectionService(const ReflectionService&) = delete;
  ReflectionService& operator=(const ReflectionService&) = delete;

  // To register with the ServerBuilder (both; their methods are async).
  grpc::Service* v1_service() { return &v1_; }
  grpc::Service* v1alpha_service() { return &v1alpha_; }

  // Starts taking ServerReflectionInfo calls of both services on `queue`
  // (the server is built and started; its threads may run already). Once.
  void Serve(QueueThreads* queue);

 private:
  using ReflectionRequest = grpc::reflection::v1::ServerReflectionRequest;
  using ReflectionResponse = grpc::reflection::v1::ServerReflectionResponse;
  using Stream = grpc::ServerAsyncReaderWriter<ReflectionResponse, ReflectionRequest>;
  // The generated RequestServerReflectionInfo of one of the two services.
  using RequestFn = std::function<void(grpc::ServerContext*, Stream*, void*)>;
  class InfoCall;

  // The answer to `request` (its host and the request itself echoed);
  // `sent`: the files the stream has sent so far, which this adds to.
  void Answer(const ReflectionRequest& request, absl::flat_hash_set<std::string>* sent,
              ReflectionResponse* response) const;
  void AnswerFile(const google::protobuf::FileDescriptor* file, absl::flat_hash_set<std::string>* sent,
                  ReflectionResponse* response) const;

  grpc::reflection::v1::ServerReflection::AsyncService v1_;
  grpc::reflection::v1alpha::ServerReflection::AsyncService v1alpha_;
  const std::vector<std::string> services_;
  const google::protobuf::DescriptorPool* const pool_;
  RequestFn request_v1_;
  RequestFn request_v1alpha_;
};

}  // namespace mlakv::server::cq
