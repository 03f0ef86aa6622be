// What the server-talking subcommands share: a client built from --server and
// --timeout_s, the one way errors and usage mistakes are reported (and the
// exit codes that go with them), and text/JSON formatting helpers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/fleet_client.h"
#include "client/kv_cache_client.h"
#include "google/protobuf/message.h"

namespace mlakv::cli {

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

// Client options from --server, --timeout_s and the TLS/token flags
// (--tls_ca, --tls_cert, --tls_key, --tls_server_name, --token_file).
absl::StatusOr<KvCacheClient::Options> ClientOptionsFromFlags();

// The server a command talks to: --server, or one server of the fleet that
// --servers/--service name (then the fleet stays alive with it).
class Connection {
 public:
  Connection(std::shared_ptr<KvCacheClient> client, std::unique_ptr<FleetClient> fleet = nullptr)
      : client_(std::move(client)), fleet_(std::move(fleet)) {}
  KvCacheClient* operator->() const { return client_.get(); }
  KvCacheClient& operator*() const { return *client_; }

 private:
  std::shared_ptr<KvCacheClient> client_;
  std::unique_ptr<FleetClient> fleet_;
};

// --servers or --service given.
bool FleetFlagsGiven();
// The fleet of --servers/--service (probed once; refreshed by no thread: a
// command is one shot).
absl::StatusOr<std::unique_ptr<FleetClient>> FleetFromFlags();
// For a command that names no sequence: --server, or the fleet's server
// --server_id (INVALID_ARGUMENT without it).
absl::StatusOr<Connection> ConnectFromFlags();
// For a command about `sequence`: --server, or the fleet's server that owns
// it (--server_id, else rendezvous over the healthy servers). Fail() then
// names that server in an UNAVAILABLE status.
absl::StatusOr<Connection> ConnectForSequence(const std::string& sequence);

// Prints "mlakv COMMAND: CODE_NAME: message" to stderr; returns kExitFailed.
int Fail(std::string_view command, const absl::Status& status);
// Prints "usage: mlakv ..." (and a reason, if any) to stderr; returns kExitUsage.
int UsageError(std::string_view usage, std::string_view reason = "");

// The proto3 JSON form of `message`, field names as in the .proto, zero
// values included, one line.
std::string ToJson(const google::protobuf::Message& message);

// A non-negative integer that fits in uint32; false for anything else.
bool ParseUint32(std::string_view text, uint32_t* value);

// A non-negative integer that fits in uint64; false for anything else.
bool ParseUint64(std::string_view text, uint64_t* value);

// A block hash given as hex on the command line ("0a1b..."; an optional 0x
// prefix): its bytes, or INVALID_ARGUMENT naming `what` and the problem.
absl::StatusOr<std::string> ParseHashHex(std::string_view what, std::string_view hex);
// Bytes as lowercase hex, for printing hashes.
std::string HexOf(std::string_view bytes);

// One line about a lease: "lease 7 on sequence s (generation G): tokens [0, 40),
// holder h, expires in 29.9s" (page leases name their pages instead).
std::string DescribeLease(const v1::Lease& lease);

// Where a region's bytes live: "shm /name +offset" or "cuda:N" (" +event" when
// the server waits on the producer's event).
std::string DescribeRegionSource(const v1::Region& region);

// Per-layer values as runs: {5, 5, 5, 0} -> "layers 0-2: 5, layer 3: 0".
std::string DescribeLayerRuns(const std::vector<uint32_t>& per_layer);

}  // namespace mlakv::cli
