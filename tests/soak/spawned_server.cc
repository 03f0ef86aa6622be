#include "tests/soak/spawned_server.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace mlakv::soak {
namespace {

// "HOST:PORT" of the server's "listening on HOST:PORT" line, once complete.
std::optional<std::string> ListeningTarget(const std::string& log) {
  static const std::regex kLine(R"(listening on (\S+):(\d+)\n)");
  std::smatch m;
  if (!std::regex_search(log, m, kLine)) return std::nullopt;
  return absl::StrCat(m[1].str(), ":", m[2].str());
}

}  // namespace

absl::StatusOr<std::unique_ptr<SpawnedServer>> SpawnedServer::Start(const Options& options) {
  if (access(options.binary.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("--spawn ", options.binary, ": not an executable"));
  }
  std::string dir = (std::filesystem::temp_directory_path() / "mlakv-soak-XXXXXX").string();
  if (mkdtemp(dir.data()) == nullptr) return absl::InternalError("mkdtemp failed");
  const std::string config = dir + "/server.txtpb";
  std::ofstream(config) << options.config_text;
  const std::vector<std::string> argv = {options.binary,
                                         "--device",
                                         options.device,
                                         "--config",
                                         config,
                                         "--listen",
                                         "127.0.0.1:0",
                                         "--drain_grace_s",
                                         absl::StrCat(options.drain_grace_s)};
  std::optional<e2e::ChildProcess> child = e2e::ChildProcess::Start(argv, dir + "/server.log");
  if (!child) return absl::InternalError("fork failed");
  std::unique_ptr<SpawnedServer> server(new SpawnedServer(dir, std::move(*child)));
  const absl::Time deadline = absl::Now() + options.ready_timeout;
  while (absl::Now() < deadline) {
    const std::string log = e2e::ReadFileOrEmpty(server->log_path_);
    if (std::optional<int> code = server->process_->Poll()) {
      return absl::UnavailableError(absl::StrCat("mlakv-server exited with ", *code, " before serving:\n", log));
    }
    if (std::optional<std::string> target = ListeningTarget(log)) {
      server->target_ = *target;
      return server;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat("mlakv-server logged no 'listening on' line within ",
                                                  absl::FormatDuration(options.ready_timeout), ":\n",
                                                  e2e::ReadFileOrEmpty(server->log_path_)));
}

SpawnedServer::~SpawnedServer() {
  if (process_) process_->Stop(absl::Seconds(10));
}

absl::StatusOr<int> SpawnedServer::Stop(absl::Duration grace) {
  const e2e::ChildProcess::Ending ending = process_->Stop(grace);
  if (ending.killed) {
    return absl::DeadlineExceededError(
        absl::StrCat("mlakv-server ignored SIGTERM for ", absl::FormatDuration(grace), " and was killed"));
  }
  return ending.code;
}

std::vector<std::string> SpawnedServer::ErrorLines() const {
  std::vector<std::string> out;
  std::ifstream in(log_path_);
  static const std::regex kColor("\x1b\\[[0-9;]*m");  // spdlog colours the level on a terminal
  for (std::string line; std::getline(in, line);) {
    // "2026-11-29T07:32:00.977Z error ..." (docs/server.md "Running").
    line = std::regex_replace(line, kColor, "");
    if (line.find("Z error ") != std::string::npos || line.find("Z critical ") != std::string::npos) {
      out.push_back(line);
    }
  }
  return out;
}

void SpawnedServer::RemoveScratch() {
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

std::optional<int64_t> ReadVmRssKb(pid_t pid) {
  if (pid <= 0) return std::nullopt;
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(in, line);) {
    if (!line.starts_with("VmRSS:")) continue;
    std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
    int64_t kb = 0;
    if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &kb)) return kb;
  }
  return std::nullopt;
}

}  // namespace mlakv::soak
