#include "server/observability/rpc_method_set.h"

#include <algorithm>

#include "google/protobuf/descriptor.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"

namespace mlakv::server {

RpcMethodSet RpcMethodSet::Served() {
  std::vector<std::pair<std::string, std::string>> methods;
  const google::protobuf::ServiceDescriptor* kv =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(v1::KvCache::service_full_name());
  // kv_cache.pb.cc is linked into this library, so its descriptor is in the
  // generated pool; a null here would be a build error, not a run-time state.
  for (int i = 0; kv != nullptr && i < kv->method_count(); ++i) {
    methods.emplace_back(kv->full_name(), kv->method(i)->name());
  }
  // grpc++ implements these two without a protobuf descriptor that is
  // guaranteed to be in the generated pool (the health service is built on
  // upb), so their methods are listed by name, as grpc 1.51 serves them.
  methods.emplace_back("grpc.health.v1.Health", "Check");
  methods.emplace_back("grpc.health.v1.Health", "Watch");
  methods.emplace_back("grpc.reflection.v1alpha.ServerReflection", "ServerReflectionInfo");
  return RpcMethodSet(methods);
}

RpcMethodSet::RpcMethodSet(const std::vector<std::pair<std::string, std::string>>& methods) {
  for (const auto& [service, method] : methods) methods_[service].insert(method);
}

bool RpcMethodSet::Contains(absl::string_view service, absl::string_view method) const {
  auto it = methods_.find(service);
  return it != methods_.end() && it->second.contains(method);
}

std::vector<std::pair<std::string, std::string>> RpcMethodSet::List() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [service, names] : methods_) {
    for (const std::string& m : names) out.emplace_back(service, m);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace mlakv::server
