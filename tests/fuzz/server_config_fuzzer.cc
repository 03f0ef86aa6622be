// libFuzzer target: the server config, text format (what `mlakv-server
// --config FILE` reads), parsed and turned into pools' options.
//
// Besides ASan/UBSan, it checks what PoolOptionsFromConfig promises of a
// config it accepts: named, unique pools, at least one page each, page_size x
// num_pages within int32 positions, a scale entry per layer.
#include <cstddef>
#include <cstdint>
#include <set>
#include <string_view>

#include "server/rpc/server_config.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<mlakv::v1::ServerConfig> config = mlakv::server::ParseServerConfig(text, "fuzz config");
  if (!config.ok()) {
    Check(config.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  // "cpu" as --device: no GPU is looked for unless a pool names cuda:N.
  absl::StatusOr<std::vector<mlakv::server::Pool::Options>> pools =
      mlakv::server::PoolOptionsFromConfig(*config, "cpu");
  if (!pools.ok()) return 0;
  Check(!pools->empty());
  std::set<std::string> names;
  for (const mlakv::server::Pool::Options& o : *pools) {
    Check(!o.name.empty() && names.insert(o.name).second);
    Check(o.num_layers > 0 && o.page_size > 0 && o.num_pages > 0);
    Check(static_cast<int64_t>(o.num_pages) * o.page_size <= INT32_MAX);
    Check(o.layer_scales.size() == static_cast<size_t>(o.num_layers));
  }
  return 0;
}
