// The real mlakv-server as a child process on a loopback port, for tests of
// what users do: started with a config (protobuf text) and a --device, ready
// once grpc.health.v1 answers SERVING, stopped (SIGTERM, then SIGKILL) when
// destroyed. Every wait is bounded.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/kv_cache_client.h"
#include "tests/e2e/child_process.h"

namespace mlakv::e2e {

// Paths baked in at configure time; environment variables of the same names win.
std::string ServerBinary();  // MLAKV_SERVER_BINARY
std::string CliBinary();     // MLAKV_CLI_BINARY

class ServerUnderTest {
 public:
  struct Options {
    std::string device = "cpu";     // --device
    std::string config_text;        // ServerConfig in text format; empty: no --config
    std::vector<std::string> extra_args;  // appended to the command line, e.g. {"--allow_ipc"}
    absl::Duration ready_timeout = absl::Seconds(60);
  };

  static absl::StatusOr<std::unique_ptr<ServerUnderTest>> Start(const Options& options);
  ~ServerUnderTest();

  // "127.0.0.1:PORT".
  const std::string& target() const { return target_; }
  // A new client of this server (its own connection).
  std::unique_ptr<KvCacheClient> NewClient(absl::Duration timeout = absl::Seconds(60)) const;
  // Runs the mlakv CLI with `args` plus --server TARGET.
  CommandResult RunCli(std::vector<std::string> args, absl::Duration timeout = absl::Seconds(120)) const;
  // The server's output so far (stdout and stderr).
  std::string Log() const;
  // SIGTERM; the exit code, or an error if it had to be killed.
  absl::StatusOr<int> Stop(absl::Duration grace = absl::Seconds(15));
  // A scratch directory that lives as long as this object.
  const std::string& scratch_dir() const { return dir_; }

 private:
  ServerUnderTest(std::string dir, std::string target, ChildProcess process)
      : dir_(std::move(dir)), target_(std::move(target)), process_(std::move(process)) {}
  std::string dir_;
  std::string target_;
  std::optional<ChildProcess> process_;
};

}  // namespace mlakv::e2e
