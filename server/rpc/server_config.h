// ServerConfig (proto/mlakv/v1/config.proto, protobuf text format): loading,
// the embedded default, validation, and the Pool::Options it describes.
//
// The embedded default (no --config): one pool "default", 61 layers, page
// size 64, 256 pages (16384 tokens; 61 x 352 x 64 x 256 bytes = 335.5 MiB of
// caches), scales unset, on --device (auto: cuda:0 if a GPU is visible, else
// cpu), listening on 127.0.0.1:50051, 64 MiB messages.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "mlakv/v1/config.pb.h"
#include "server/core/pool.h"

namespace mlakv::server {

inline constexpr char kDefaultListen[] = "127.0.0.1:50051";
inline constexpr char kDefaultPoolName[] = "default";
inline constexpr uint32_t kDefaultNumLayers = 61;
inline constexpr uint32_t kDefaultPageSize = 64;
inline constexpr uint32_t kDefaultNumPages = 256;
inline constexpr uint32_t kDefaultMaxMessageBytes = 64u << 20;
// Limits (docs/reliability.md "Limits"); a 0 in the config means these.
inline constexpr uint32_t kDefaultMaxSequences = 1u << 20;
inline constexpr uint32_t kDefaultAppendIdleTimeoutSeconds = 60;
inline constexpr uint32_t kDefaultMaxRegions = 256;
// KV events (EventsConfig): events kept for replay and the bytes they may
// hold, WatchEvents streams at once.
inline constexpr uint32_t kDefaultEventReplayCapacity = 65536;
inline constexpr uint64_t kDefaultEventReplayBytes = uint64_t{64} << 20;
inline constexpr int kDefaultMaxWatchers = 64;
inline constexpr uint32_t kDefaultZmqReplayBatches = 10000;
inline constexpr uint64_t kDefaultZmqReplayBytes = uint64_t{64} << 20;
inline constexpr uint32_t kDefaultZmqMaxReplays = 16;
inline constexpr uint32_t kDefaultZmqSendQueue = 1000;  // ZeroMQ's own default
inline constexpr uint32_t kMaxZmqSendQueue = 100000;
inline constexpr uint64_t kDefaultMaxRegionBytes = 1ull << 40;

// The config with no file: one default pool, everything else unset.
v1::ServerConfig DefaultServerConfig();

// Reads and parses a text-format file; errors name the file, line and column.
absl::StatusOr<v1::ServerConfig> LoadServerConfig(const std::string& path);

// Parses text-format `text` (what LoadServerConfig reads from its file);
// errors are INVALID_ARGUMENT naming `source`, the line and the column.
absl::StatusOr<v1::ServerConfig> ParseServerConfig(std::string_view text, std::string_view source = "config text");

// Checks a config and turns its pools into Pool::Options, filling defaults
// (num_layers 61, page_size 64, 256 pages when neither num_pages nor
// cache_bytes is given; an unnamed single pool is "default"). Each pool's
// device is its own, else `default_device`; "auto" is resolved. Errors are
// INVALID_ARGUMENT naming the pool and the field.
absl::StatusOr<std::vector<Pool::Options>> PoolOptionsFromConfig(const v1::ServerConfig& config,
                                                                 const std::string& default_device);

}  // namespace mlakv::server
