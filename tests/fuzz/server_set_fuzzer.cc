// The fleet's server-set parsers (client/server_set.h): --servers lists and
// --service dns:///NAME:PORT targets, as a user (or a script) types them.
// Every input either parses into entries that are host:port with a port in
// 1..65535, or fails INVALID_ARGUMENT with a bounded message; placement over
// what parsed always picks one of the entries.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "client/rendezvous.h"
#include "client/server_set.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (bool service : {false, true}) {
    absl::StatusOr<mlakv::ServerSetSpec> spec = service ? mlakv::ParseServiceTarget(text) : mlakv::ParseServerList(text);
    if (!spec.ok()) {
      if (spec.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
      if (spec.status().message().size() > 1024) std::abort();  // quotes are bounded
      continue;
    }
    if (service) {
      if (spec->dns_name.empty() || spec->port < 1 || spec->port > 65535) std::abort();
      continue;
    }
    if (spec->servers.empty()) std::abort();
    std::vector<std::string_view> keys(spec->servers.begin(), spec->servers.end());
    const int picked = mlakv::PickRendezvous(text, keys);
    if (picked < 0 || static_cast<size_t>(picked) >= keys.size()) std::abort();
  }
  return 0;
}
