// SpawnedServer: the mlakv-server the soak starts itself (--spawn): written
// config, 127.0.0.1:0, the bound port read from its "listening on HOST:PORT"
// line, stopped with SIGTERM at the end. Its log is kept in a scratch
// directory, scanned at the end for lines logged at error.
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/e2e/child_process.h"

namespace mlakv::soak {

class SpawnedServer {
 public:
  struct Options {
    std::string binary;       // path to mlakv-server
    std::string device;       // --device
    std::string config_text;  // ServerConfig, protobuf text format
    absl::Duration ready_timeout = absl::Seconds(60);
    int drain_grace_s = 5;
  };
  static absl::StatusOr<std::unique_ptr<SpawnedServer>> Start(const Options& options);
  ~SpawnedServer();

  const std::string& target() const { return target_; }
  pid_t pid() const { return process_ ? process_->pid() : -1; }
  const std::string& log_path() const { return log_path_; }
  // SIGTERM; the exit code, or an error when it had to be killed.
  absl::StatusOr<int> Stop(absl::Duration grace);
  // Lines of the log at level error or critical (a bug the server noticed itself).
  std::vector<std::string> ErrorLines() const;
  // Removes the scratch directory (kept when a run failed, for the log).
  void RemoveScratch();

 private:
  SpawnedServer(std::string dir, e2e::ChildProcess process)
      : dir_(std::move(dir)), log_path_(dir_ + "/server.log"), process_(std::move(process)) {}
  std::string dir_;
  std::string log_path_;
  std::string target_;
  std::optional<e2e::ChildProcess> process_;
};

// VmRSS of a process in KiB, from /proc/PID/status; nullopt when unreadable.
std::optional<int64_t> ReadVmRssKb(pid_t pid);

}  // namespace mlakv::soak
