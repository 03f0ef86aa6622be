#include "tests/e2e/server_under_test.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace mlakv::e2e {
namespace {

std::string FromEnvOr(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

// A loopback port nobody listens on right now (the kernel's pick for port 0).
absl::StatusOr<int> PickFreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  close(fd);
  if (!ok) return absl::InternalError("cannot bind a loopback port");
  return ntohs(addr.sin_port);
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
  // A port picked here could be taken before the server binds it: retry.
  absl::Status last = absl::UnknownError("not started");
  for (int attempt = 0; attempt < 3; ++attempt) {
    absl::StatusOr<int> port = PickFreePort();
    if (!port.ok()) return port.status();
    const std::string target = absl::StrCat("127.0.0.1:", *port);
    std::vector<std::string> args = argv;
    args.insert(args.end(), {"--listen", target});
    const std::string log = dir + "/server.log";
    std::optional<ChildProcess> child = ChildProcess::Start(args, log);
    if (!child) return absl::InternalError("fork failed");
    std::unique_ptr<ServerUnderTest> server(new ServerUnderTest(dir, target, std::move(*child)));

    const absl::Time deadline = absl::Now() + options.ready_timeout;
    while (absl::Now() < deadline) {
      // A fresh channel each time: a channel that failed to connect waits out
      // gRPC's reconnect backoff (1 s, 1.6 s, ...) before it tries again.
      last = server->NewClient()->CheckHealth(absl::Milliseconds(500));
      if (last.ok()) return server;
      if (std::optional<int> code = server->process_->Poll()) {
        last = absl::UnavailableError(absl::StrCat("server exited with ", *code, " before serving:\n", server->Log()));
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!server->process_->Poll()) {  // still running yet never healthy: give up
      return absl::DeadlineExceededError(absl::StrCat("server on ", target, " not SERVING after ",
                                                      absl::FormatDuration(options.ready_timeout), ": ",
                                                      last.message(), "\n", server->Log()));
    }
    server->dir_.clear();  // keep the directory for the next attempt
  }
  return last;
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
