// mlakv-server: flags, logging, signals; everything else is KvCacheServer.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/kv_cache_server.h"
#include "server/server_config.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, listen, "",
          "host:port to serve on (empty: the config's listen, else 127.0.0.1:50051); port 0 picks a free port, "
          "logged as 'listening on HOST:PORT'. Overrides the config's listen.");
ABSL_FLAG(std::string, device, "auto",
          "device for pools that name none: auto (cuda:0 if a GPU is visible, else cpu), cpu, or cuda:N");
ABSL_FLAG(std::string, config, "",
          "ServerConfig in protobuf text format (proto/mlakv/v1/config.proto); empty: the embedded default pool "
          "(61 layers, page size 64, 256 pages, scales set by the first append)");
ABSL_FLAG(std::string, log_level, "info", "trace, debug (one line per request), info, warn, error, off");
ABSL_FLAG(int32_t, shutdown_grace_seconds, 10,
          "on SIGTERM/SIGINT, how long calls in flight may run before they are cancelled");

namespace mlakv::server {
namespace {

#ifndef MLAKV_VERSION
#define MLAKV_VERSION "unknown"
#endif

std::string HumanBytes(uint64_t bytes) {
  if (bytes >= (1ull << 30)) return absl::StrCat(absl::SixDigits(bytes / double(1ull << 30)), " GiB");
  return absl::StrCat(absl::SixDigits(bytes / double(1ull << 20)), " MiB");
}

int RunServer() {
  // Block the stop signals in every thread (gRPC's included); this thread
  // waits for them with sigwait.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);

  v1::ServerConfig config = DefaultServerConfig();
  const std::string config_path = absl::GetFlag(FLAGS_config);
  if (!config_path.empty()) {
    absl::StatusOr<v1::ServerConfig> loaded = LoadServerConfig(config_path);
    if (!loaded.ok()) {
      spdlog::critical("{}", std::string(loaded.status().message()));
      return 2;
    }
    config = *loaded;
  }
  std::string listen = absl::GetFlag(FLAGS_listen);
  if (listen.empty()) listen = config.listen().empty() ? kDefaultListen : config.listen();
  const std::string device = absl::GetFlag(FLAGS_device);
  if (device != "auto") {
    if (absl::Status s = CheckDeviceName(device); !s.ok()) {
      spdlog::critical("--device: {}", std::string(s.message()));
      return 2;
    }
  }

  absl::StatusOr<std::unique_ptr<KvCacheServer>> server =
      KvCacheServer::Create({.config = config, .listen = listen, .default_device = device});
  if (!server.ok()) {
    spdlog::critical("cannot start: {}", std::string(server.status().message()));
    return 1;
  }
  spdlog::info("mlakv-server {} (config: {})", MLAKV_VERSION, config_path.empty() ? "embedded default" : config_path);
  for (const auto& pool : (*server)->pools()) {
    const PoolSnapshot p = pool->Snapshot();
    int fixed = 0;
    for (const LayerSnapshot& l : p.layers) fixed += l.scales_from_config ? 1 : 0;
    spdlog::info("pool '{}': device {}, {} layers, {} pages x {} tokens, {} cache bytes ({}), scales fixed for {} of {} "
                 "layers",
                 p.name, p.device, p.num_layers, p.pages_total, p.page_size, p.cache_bytes, HumanBytes(p.cache_bytes),
                 fixed, p.num_layers);
  }
  spdlog::info("listening on {}", (*server)->bound_address());
  spdlog::default_logger()->flush();

  int signal = 0;
  sigwait(&stop, &signal);
  spdlog::info("received {}", signal == SIGTERM ? "SIGTERM" : "SIGINT");
  (*server)->Shutdown(absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_seconds)));
  server->reset();
  spdlog::info("stopped");
  return 0;
}

}  // namespace
}  // namespace mlakv::server

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "mlakv-server: gRPC service owning NVFP4 MLA paged KV-cache pools.\n"
      "  mlakv-server                       embedded default pool on --device=auto, 127.0.0.1:50051\n"
      "  mlakv-server --listen 0.0.0.0:50051 --device cuda:0 --config pools.txtpb");
  absl::ParseCommandLine(argc, argv);
  auto logger = spdlog::stderr_color_mt("mlakv");
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%eZ %^%l%$ %v", spdlog::pattern_time_type::utc);
  const spdlog::level::level_enum level = spdlog::level::from_str(absl::GetFlag(FLAGS_log_level));
  if (level == spdlog::level::off && absl::GetFlag(FLAGS_log_level) != "off") {
    std::fprintf(stderr, "--log_level '%s' is not one of trace, debug, info, warn, error, off\n",
                 absl::GetFlag(FLAGS_log_level).c_str());
    return 2;
  }
  spdlog::set_level(level);
  spdlog::flush_on(spdlog::level::info);
  return mlakv::server::RunServer();
}
