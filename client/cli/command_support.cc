#include "client/cli/command_support.h"

#include <cstdio>
#include <fstream>
#include <optional>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/cli/cli_flags.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"

namespace mlakv::cli {

absl::StatusOr<KvCacheClient::Options> ClientOptionsFromFlags() {
  KvCacheClient::Options options;
  options.target = absl::GetFlag(FLAGS_server);
  options.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  // ---- transport security ----
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (const std::string path = absl::GetFlag(FLAGS_token_file); !path.empty()) {
    std::ifstream in(path);
    std::string token;
    if (!in || !std::getline(in, token)) return absl::NotFoundError(absl::StrCat("--token_file ", path, ": cannot read"));
    options.token = std::string(absl::StripAsciiWhitespace(token));
    if (options.token.empty()) return absl::InvalidArgumentError(absl::StrCat("--token_file ", path, ": empty token"));
  }
  // ---- end transport security ----
  return options;
}

namespace {

// The fleet server this command was routed to and for which sequence, for
// Fail(); unset without a fleet.
struct Routed {
  FleetClient::Route route;
  std::string sequence;
};
std::optional<Routed>& RoutedTo() {
  static auto* routed = new std::optional<Routed>();
  return *routed;
}

absl::StatusOr<Connection> ConnectToFleetServer(const std::string& sequence) {
  MLAKV_ASSIGN_OR_RETURN(std::unique_ptr<FleetClient> fleet, FleetFromFlags());
  const std::string server_id = absl::GetFlag(FLAGS_server_id);
  if (sequence.empty() && server_id.empty()) {
    return absl::InvalidArgumentError(
        "this command names no sequence, so placement cannot pick a server: with --servers/--service give "
        "--server_id ID (mlakv pools lists every server's id)");
  }
  MLAKV_ASSIGN_OR_RETURN(FleetClient::Route route, fleet->RouteFor(sequence, server_id));
  RoutedTo() = Routed{.route = route, .sequence = sequence};
  return Connection(route.client, std::move(fleet));
}

}  // namespace

bool FleetFlagsGiven() { return !absl::GetFlag(FLAGS_servers).empty() || !absl::GetFlag(FLAGS_service).empty(); }

absl::StatusOr<std::unique_ptr<FleetClient>> FleetFromFlags() {
  const std::string servers = absl::GetFlag(FLAGS_servers);
  const std::string service = absl::GetFlag(FLAGS_service);
  if (!servers.empty() && !service.empty()) {
    return absl::InvalidArgumentError("give --servers or --service, not both");
  }
  FleetClient::Options options;
  MLAKV_ASSIGN_OR_RETURN(options.client, ClientOptionsFromFlags());
  if (!servers.empty()) {
    MLAKV_ASSIGN_OR_RETURN(options.servers, ParseServerList(servers));
  } else {
    MLAKV_ASSIGN_OR_RETURN(options.servers, ParseServiceTarget(service));
  }
  options.refresh_interval = absl::ZeroDuration();
  options.probe_timeout = std::min(options.client.timeout, absl::Seconds(5));
  return FleetClient::Create(std::move(options));
}

absl::StatusOr<Connection> ConnectFromFlags() {
  if (FleetFlagsGiven()) return ConnectToFleetServer("");
  MLAKV_ASSIGN_OR_RETURN(KvCacheClient::Options options, ClientOptionsFromFlags());
  MLAKV_ASSIGN_OR_RETURN(std::unique_ptr<KvCacheClient> client, KvCacheClient::Create(options));
  return Connection(std::move(client));
}

absl::StatusOr<Connection> ConnectForSequence(const std::string& sequence) {
  if (FleetFlagsGiven()) return ConnectToFleetServer(sequence);
  return ConnectFromFlags();
}

int Fail(std::string_view command, const absl::Status& failure) {
  // Routed through a fleet: name the server (FleetClient::Explain).
  const absl::Status status = RoutedTo() ? FleetClient::Explain(RoutedTo()->route, RoutedTo()->sequence, failure)
                                         : failure;
  std::fprintf(stderr, "mlakv %.*s: %s: %.*s\n", static_cast<int>(command.size()), command.data(),
               absl::StatusCodeToString(status.code()).c_str(), static_cast<int>(status.message().size()),
               status.message().data());
  return kExitFailed;
}

int UsageError(std::string_view usage, std::string_view reason) {
  if (!reason.empty()) std::fprintf(stderr, "%.*s\n", static_cast<int>(reason.size()), reason.data());
  std::fprintf(stderr, "usage: mlakv %.*s\n", static_cast<int>(usage.size()), usage.data());
  return kExitUsage;
}

std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string text;
  // Printing a well-formed message cannot fail; an empty object is the fallback.
  if (!google::protobuf::util::MessageToJsonString(message, &text, options).ok()) text = "{}";
  return text;
}

bool ParseUint32(std::string_view text, uint32_t* value) {
  return !text.empty() && text[0] != '-' && text[0] != '+' &&
         absl::SimpleAtoi(absl::string_view(text.data(), text.size()), value);
}

bool ParseUint64(std::string_view text, uint64_t* value) {
  return !text.empty() && text[0] != '-' && text[0] != '+' &&
         absl::SimpleAtoi(absl::string_view(text.data(), text.size()), value);
}

absl::StatusOr<std::string> ParseHashHex(std::string_view what_view, std::string_view hex_view) {
  const absl::string_view what(what_view.data(), what_view.size());
  const absl::string_view hex(hex_view.data(), hex_view.size());
  absl::string_view h = hex;
  if (absl::StartsWith(h, "0x") || absl::StartsWith(h, "0X")) h.remove_prefix(2);
  if (h.empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": empty; a block hash is 1..64 bytes of hex"));
  if (h.size() % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " \"", hex, "\" has ", h.size(), " hex digits; a hash is whole bytes (an even count)"));
  }
  for (size_t i = 0; i < h.size(); ++i) {
    if (!absl::ascii_isxdigit(h[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " \"", hex, "\": '", h.substr(i, 1), "' at digit ", i, " is not a hex digit"));
    }
  }
  return absl::HexStringToBytes(h);
}

std::string HexOf(std::string_view bytes) { return absl::BytesToHexString(absl::string_view(bytes.data(), bytes.size())); }

std::string DescribeLease(const v1::Lease& lease) {
  std::string text = absl::StrCat("lease ", lease.lease_id());
  if (!lease.sequence().empty()) {
    absl::StrAppend(&text, " on sequence ", lease.sequence(), " (generation ", lease.generation(),
                    lease.sequence_freed() ? ", freed" : "", "): tokens [0, ", lease.tokens(), ")");
  } else {
    absl::StrAppend(&text, " on ", lease.pages_size(), " page(s) [", absl::StrJoin(lease.pages(), ", "), "] (",
                    lease.tokens(), " tokens)");
  }
  const int64_t left_ms = lease.expire_time_unix_ms() - absl::ToUnixMillis(absl::Now());
  absl::StrAppend(&text, ", holder ", lease.holder(), ", ",
                  left_ms > 0 ? absl::StrCat("expires in ", absl::FormatDuration(absl::Milliseconds(left_ms)))
                              : std::string("expired"),
                  " (duration ", lease.duration_ms(), " ms)");
  return text;
}

std::string DescribeRegionSource(const v1::Region& region) {
  if (region.kind() == v1::REGION_KIND_SHM) return absl::StrCat("shm ", region.shm_name(), " +", region.shm_offset());
  if (region.kind() == v1::REGION_KIND_CUDA) {
    return absl::StrCat("cuda:", region.device_id(), region.has_event() ? " +event" : "");
  }
  return "unknown source";
}

std::string DescribeLayerRuns(const std::vector<uint32_t>& per_layer) {
  std::string text;
  for (size_t begin = 0; begin < per_layer.size();) {
    size_t end = begin + 1;
    while (end < per_layer.size() && per_layer[end] == per_layer[begin]) ++end;
    if (!text.empty()) text += ", ";
    if (end - begin == 1) {
      absl::StrAppend(&text, "layer ", begin, ": ", per_layer[begin]);
    } else {
      absl::StrAppend(&text, "layers ", begin, "-", end - 1, ": ", per_layer[begin]);
    }
    begin = end;
  }
  return text.empty() ? "no layers" : text;
}

}  // namespace mlakv::cli
