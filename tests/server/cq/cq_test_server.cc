#include "tests/server/cq/cq_test_server.h"

#include <chrono>
#include <string>

namespace mlakv::server::cq::testing {

CqTestServer::CqTestServer(const std::vector<grpc::Service*>& services, int threads, absl::Duration poll_period,
                           grpc::AsyncGenericService* generic) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  for (grpc::Service* s : services) builder.RegisterService(s);
  if (generic != nullptr) builder.RegisterAsyncGenericService(generic);
  std::unique_ptr<grpc::ServerCompletionQueue> queue = builder.AddCompletionQueue();
  server_ = builder.BuildAndStart();
  threads_ = std::make_unique<QueueThreads>(std::move(queue), threads, "cq-test", poll_period);
  if (server_ == nullptr || port == 0) {
    server_.reset();
    return;
  }
  threads_->Start();
  channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
}

CqTestServer::~CqTestServer() { Stop(); }

void CqTestServer::Stop() {
  if (stopped_) return;
  stopped_ = true;
  if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
  threads_->Shutdown();
}

}  // namespace mlakv::server::cq::testing
