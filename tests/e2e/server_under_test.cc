#include "tests/e2e/server_under_test.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string_view>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace mlakv::e2e {
namespace {

std::string FromEnvOr(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

// The port of the server's "listening on 127.0.0.1:PORT" line, once that
// line is complete in `log`.
std::optional<int> ListeningPort(const std::string& log) {
  constexpr std::string_view kPrefix = "listening on 127.0.0.1:";
  const size_t at = log.find(kPrefix);
  if (at == std::string::npos) return std::nullopt;
  const size_t begin = at + kPrefix.size();
  const size_t end = log.find('\n', begin);
  int port = 0;
  if (end == std::string::npos || !absl::SimpleAtoi(absl::string_view(log).substr(begin, end - begin), &port)) {
    return std::nullopt;
  }
  return port;
}

}  // namespace

std::string ServerBinary() { return FromEnvOr("MLAKV_SERVER_BINARY", MLAKV_SERVER_BINARY); }
std::string CliBinary() { return FromEnvOr("MLAKV_CLI_BINARY", MLAKV_CLI_BINARY); }

absl::StatusOr<std::unique_ptr<ServerUnderTest>> ServerUnderTest::Start(const Options& options) {
  const std::string binary = ServerBinary();
  if (access(binary.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("no server binary at ", binary,
                                                      " (build mlakv-server, or set MLAKV_SERVER_BINARY)"));
  }
  std::string dir = absl::StrCat(std::filesystem::temp_directory_path().string(), "/mlakv-e2e-XXXXXX");
  if (mkdtemp(dir.data()) == nullptr) return absl::InternalError("mkdtemp failed");

  std::vector<std::string> argv = {binary, "--device", options.device};
  if (!options.config_text.empty()) {
    const std::string config = dir + "/server.textproto";
    std::ofstream(config) << options.config_text;
    argv.insert(argv.end(), {"--config", config});
  }
  argv.insert(argv.end(), options.extra_args.begin(), options.extra_args.end());
  // Port 0: the server binds a free port itself and logs it, so no other
  // process can take the port between a pick here and the server's bind.
  argv.insert(argv.end(), {"--listen", "127.0.0.1:0"});
  std::optional<ChildProcess> child = ChildProcess::Start(argv, dir + "/server.log");
  if (!child) return absl::InternalError("fork failed");
  std::unique_ptr<ServerUnderTest> server(new ServerUnderTest(dir, "", std::move(*child)));

  const absl::Time deadline = absl::Now() + options.ready_timeout;
  absl::Status last = absl::UnavailableError("no 'listening on' line in the server's log");
  while (absl::Now() < deadline) {
    if (std::optional<int> code = server->process_->Poll()) {
      return absl::UnavailableError(absl::StrCat("server exited with ", *code, " before serving:\n", server->Log()));
    }
    if (server->target_.empty()) {
      if (std::optional<int> port = ListeningPort(server->Log())) server->target_ = absl::StrCat("127.0.0.1:", *port);
    }
    if (!server->target_.empty()) {
      // A fresh channel each time: a channel that failed to connect waits out
      // gRPC's reconnect backoff (1 s, 1.6 s, ...) before it tries again.
      last = server->NewClient()->CheckHealth(absl::Milliseconds(500));
      if (last.ok()) return server;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat("server not SERVING after ", absl::FormatDuration(options.ready_timeout),
                                                  ": ", last.message(), "\n", server->Log()));
}

ServerUnderTest::~ServerUnderTest() {
  if (process_) process_->Stop(absl::Seconds(10));
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

std::unique_ptr<KvCacheClient> ServerUnderTest::NewClient(absl::Duration timeout) const {
  KvCacheClient::Options options;
  options.target = target_;
  options.timeout = timeout;
  return std::move(KvCacheClient::Create(options).value());
}

CommandResult ServerUnderTest::RunCli(std::vector<std::string> args, absl::Duration timeout) const {
  args.insert(args.begin(), CliBinary());
  args.insert(args.end(), {"--server", target_});
  return RunCommand(args, timeout);
}

std::string ServerUnderTest::Log() const { return ReadFileOrEmpty(dir_.empty() ? "" : dir_ + "/server.log"); }

absl::StatusOr<int> ServerUnderTest::Stop(absl::Duration grace) {
  const ChildProcess::Ending ending = process_->Stop(grace);
  if (ending.killed) {
    return absl::DeadlineExceededError(
        absl::StrCat("server ignored SIGTERM for ", absl::FormatDuration(grace), "; killed"));
  }
  return ending.code;
}

}  // namespace mlakv::e2e
