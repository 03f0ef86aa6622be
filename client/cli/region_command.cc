// mlakv region register-shm | register-cuda | unregister: manage the regions
// (server --allow_ipc) that `mlakv append --ckv_region/--kpe_region` and
// producers name instead of sending rows as bytes (docs/server.md "Regions").
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

ABSL_FLAG(std::string, name, "", "region: region name (1..256 bytes, unique in the server)");
ABSL_FLAG(std::string, shm_name, "", "region register-shm: POSIX shared-memory object as for shm_open, \"/name\"");
ABSL_FLAG(uint64_t, offset, 0, "region register-shm: byte offset of the region inside the shared-memory object");
ABSL_FLAG(uint64_t, size, 0,
          "region: bytes of the region (register-shm: 0 = to the end of the object; register-cuda: required)");
ABSL_FLAG(std::string, handle_file, "",
          "region register-cuda: file holding the cudaIpcMemHandle_t: its 64 raw bytes, or 128 hex digits");
ABSL_FLAG(std::string, handle_hex, "", "region register-cuda: the cudaIpcMemHandle_t as 128 hex digits");
ABSL_FLAG(std::string, event_handle_file, "",
          "region register-cuda: optional file holding a cudaIpcEventHandle_t (64 raw bytes or 128 hex digits)");
ABSL_FLAG(std::string, event_handle_hex, "", "region register-cuda: optional cudaIpcEventHandle_t as 128 hex digits");
ABSL_FLAG(int32_t, device_id, -1, "region register-cuda: CUDA device of the allocation, in the server's numbering");

namespace mlakv::cli {
namespace {

constexpr char kUsage[] =
    "region register-shm --name N --shm_name /OBJ [--offset B] [--size B] [--server ADDR] [--json]\n"
    "       mlakv region register-cuda --name N (--handle_file F | --handle_hex HEX) --device_id D --size B\n"
    "                                 [--event_handle_file F | --event_handle_hex HEX] [--server ADDR] [--json]\n"
    "       mlakv region unregister --name N [--server ADDR] [--json]";
constexpr size_t kIpcHandleBytes = 64;  // cudaIpcMemHandle_t and cudaIpcEventHandle_t

// 128 hex digits -> 64 bytes.
absl::StatusOr<std::string> ParseHexHandle(const char* what, absl::string_view hex) {
  hex = absl::StripAsciiWhitespace(hex);
  if (hex.size() != 2 * kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, " has ", hex.size(), " characters; a handle is ",
                                                   2 * kIpcHandleBytes, " hex digits (", kIpcHandleBytes,
                                                   " bytes)"));
  }
  for (size_t i = 0; i < hex.size(); ++i) {
    if (!absl::ascii_isxdigit(hex[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": '", hex.substr(i, 1), "' at character ", i, " is not a hex digit"));
    }
  }
  return absl::HexStringToBytes(hex);
}

// A handle from --X_file (64 raw bytes or 128 hex digits) or --X_hex; empty
// when neither is given.
absl::StatusOr<std::string> HandleFromFlags(const char* file_flag, const std::string& file, const char* hex_flag,
                                            const std::string& hex) {
  if (!file.empty() && !hex.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("give --", file_flag, " or --", hex_flag, ", not both"));
  }
  if (!hex.empty()) return ParseHexHandle(absl::StrCat("--", hex_flag).c_str(), hex);
  if (file.empty()) return std::string();
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--", file_flag, " ", file, ": cannot open"));
  std::ostringstream content;
  content << in.rdbuf();
  if (content.str().size() == kIpcHandleBytes) return content.str();
  absl::StatusOr<std::string> parsed =
      ParseHexHandle(absl::StrCat("--", file_flag, " ", file).c_str(), content.str());
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(parsed.status().message(), " (or the file holds ",
                                                   content.str().size(), " bytes, not the ", kIpcHandleBytes,
                                                   " raw bytes of a handle)"));
  }
  return parsed;
}

int PrintRegion(const char* verb, const v1::Region& region) {
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ToJson(region).c_str());
  } else {
    std::printf("%s region %s: %llu bytes, %s\n", verb, region.name().c_str(),
                static_cast<unsigned long long>(region.byte_size()), DescribeRegionSource(region).c_str());
  }
  return kExitOk;
}

int RegisterShm(const std::string& name) {
  const std::string shm_name = absl::GetFlag(FLAGS_shm_name);
  if (shm_name.empty()) return UsageError(kUsage, "mlakv region register-shm: --name and --shm_name are required");
  absl::StatusOr<Connection> client = ConnectFromFlags();
  if (!client.ok()) return Fail("region register-shm", client.status());
  absl::StatusOr<v1::Region> region =
      (*client)->RegisterShmRegion(name, shm_name, absl::GetFlag(FLAGS_offset), absl::GetFlag(FLAGS_size));
  if (!region.ok()) return Fail("region register-shm", region.status());
  return PrintRegion("registered", *region);
}

int RegisterCuda(const std::string& name) {
  const int32_t device = absl::GetFlag(FLAGS_device_id);
  const uint64_t size = absl::GetFlag(FLAGS_size);
  absl::StatusOr<std::string> handle =
      HandleFromFlags("handle_file", absl::GetFlag(FLAGS_handle_file), "handle_hex", absl::GetFlag(FLAGS_handle_hex));
  if (!handle.ok()) return UsageError(kUsage, absl::StrCat("mlakv region register-cuda: ", handle.status().message()));
  absl::StatusOr<std::string> event = HandleFromFlags("event_handle_file", absl::GetFlag(FLAGS_event_handle_file),
                                                      "event_handle_hex", absl::GetFlag(FLAGS_event_handle_hex));
  if (!event.ok()) return UsageError(kUsage, absl::StrCat("mlakv region register-cuda: ", event.status().message()));
  if (handle->empty() || device < 0 || size == 0) {
    return UsageError(kUsage,
                      "mlakv region register-cuda: --name, --handle_file or --handle_hex, --device_id (>= 0) and "
                      "--size (> 0) are required");
  }
  absl::StatusOr<Connection> client = ConnectFromFlags();
  if (!client.ok()) return Fail("region register-cuda", client.status());
  absl::StatusOr<v1::Region> region = (*client)->RegisterCudaRegion(name, *handle, device, size, *event);
  if (!region.ok()) return Fail("region register-cuda", region.status());
  return PrintRegion("registered", *region);
}

int Unregister(const std::string& name) {
  absl::StatusOr<Connection> client = ConnectFromFlags();
  if (!client.ok()) return Fail("region unregister", client.status());
  absl::StatusOr<uint32_t> in_flight = (*client)->UnregisterRegion(name);
  if (!in_flight.ok()) return Fail("region unregister", in_flight.status());
  if (absl::GetFlag(FLAGS_json)) {
    v1::UnregisterRegionResponse response;
    response.set_appends_in_flight(*in_flight);
    std::printf("%s\n", ToJson(response).c_str());
  } else {
    std::printf("unregistered region %s (%u append(s) in flight still hold it)\n", name.c_str(), *in_flight);
  }
  return kExitOk;
}

}  // namespace

int RunRegion(const std::vector<std::string>& args) {
  if (args.size() != 1) return UsageError(kUsage, "mlakv region takes one subcommand");
  const std::string name = absl::GetFlag(FLAGS_name);
  if (name.empty()) return UsageError(kUsage, absl::StrCat("mlakv region ", args[0], ": --name is required"));
  if (args[0] == "register-shm") return RegisterShm(name);
  if (args[0] == "register-cuda") return RegisterCuda(name);
  if (args[0] == "unregister") return Unregister(name);
  return UsageError(kUsage, absl::StrCat("mlakv region: unknown subcommand \"", args[0],
                                         "\" (register-shm, register-cuda, unregister)"));
}

}  // namespace mlakv::cli
