// mlakv export-pool: the CUDA IPC handles of a cuda pool's caches and their
// layout (server --allow_ipc), for a decode process on the same host that maps
// the caches itself (docs/server.md "ExportPool"). Text shows each handle in
// hex; --json is the proto3 JSON form (handles in base64).
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/escaping.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

namespace mlakv::cli {
namespace {

void PrintBuffer(const char* what, const v1::ExportedBuffer& buffer) {
  std::printf("    %-12s handle %s offset %llu bytes %llu entry_stride %u\n", what,
              absl::BytesToHexString(buffer.raw_handle()).c_str(), static_cast<unsigned long long>(buffer.offset()),
              static_cast<unsigned long long>(buffer.byte_size()), buffer.entry_stride_bytes());
}

}  // namespace

int RunExportPool(const std::vector<std::string>& args) {
  if (!args.empty()) {
    return UsageError("export-pool [--pool P] [--server ADDR] [--json]", "mlakv export-pool takes no arguments");
  }
  absl::StatusOr<Connection> client = ConnectFromFlags();
  if (!client.ok()) return Fail("export-pool", client.status());
  absl::StatusOr<v1::ExportPoolResponse> exported = (*client)->ExportPool(absl::GetFlag(FLAGS_pool));
  if (!exported.ok()) return Fail("export-pool", exported.status());

  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ToJson(*exported).c_str());
    return kExitOk;
  }
  std::printf("pool %s on cuda:%d: %d layer(s), %u pages of %u tokens, format %s\n", exported->pool().c_str(),
              exported->device_id(), exported->layers_size(), exported->num_pages(), exported->page_size(),
              v1::CacheFormat_Name(exported->format()).c_str());
  for (const v1::ExportedLayer& layer : exported->layers()) {
    std::printf("  layer %u (ckv_scale %.9g, kpe_scale %.9g)\n", layer.layer(), layer.ckv_scale(), layer.kpe_scale());
    PrintBuffer("ckv_cache", layer.ckv_cache());
    PrintBuffer("ckv_sf_cache", layer.ckv_sf_cache());
    PrintBuffer("kpe_cache", layer.kpe_cache());
  }
  return kExitOk;
}

}  // namespace mlakv::cli
