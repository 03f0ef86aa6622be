// Running programs from tests, always bounded in time: a command run to
// completion with its output captured (RunCommand), and a long-lived child
// that is stopped with SIGTERM, then SIGKILL (ChildProcess).
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace mlakv::e2e {

struct CommandResult {
  int exit_code = -1;  // -1 when killed by a signal or timed out
  bool timed_out = false;
  std::string out;     // stdout
  std::string err;     // stderr
  std::string Describe() const;  // for assertion messages
};

// Runs argv[0] (a path) with argv; kills it after `timeout`.
CommandResult RunCommand(const std::vector<std::string>& argv, absl::Duration timeout = absl::Seconds(60));

class ChildProcess {
 public:
  // Starts argv with stdout and stderr appended to `log_path`.
  static std::optional<ChildProcess> Start(const std::vector<std::string>& argv, const std::string& log_path);
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&&) = delete;
  ~ChildProcess();

  // The exit status if it has ended (without waiting).
  std::optional<int> Poll();
  // SIGTERM, wait up to `grace`, then SIGKILL. Returns the exit code (or
  // 128 + signal) and whether it needed the SIGKILL.
  struct Ending {
    int code = -1;
    bool killed = false;
  };
  Ending Stop(absl::Duration grace);
  // The process id (for /proc readings), -1 once moved from.
  pid_t pid() const { return pid_; }

 private:
  explicit ChildProcess(pid_t pid) : pid_(pid) {}
  pid_t pid_ = -1;
  std::optional<int> ended_;
};

// Reads a whole file ("" if it cannot).
std::string ReadFileOrEmpty(const std::string& path);

}  // namespace mlakv::e2e
