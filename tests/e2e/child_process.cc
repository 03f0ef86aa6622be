#include "tests/e2e/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace mlakv::e2e {
namespace {

int DecodeWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// fork + exec with stdout/stderr redirected to files; -1 on failure.
pid_t Spawn(const std::vector<std::string>& argv, const std::string& out_path, const std::string& err_path) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid != 0) return pid;
  // Child: only async-signal-safe calls until exec.
  const int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  const int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  const int in = open("/dev/null", O_RDONLY);
  if (out < 0 || err < 0 || in < 0) _exit(126);
  dup2(in, 0);
  dup2(out, 1);
  dup2(err, 2);
  execv(args[0], args.data());
  _exit(127);
}

// Waits for `pid` until `timeout`; nullopt when it is still running.
std::optional<int> WaitFor(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return DecodeWaitStatus(status);
    if (r < 0) return -1;
    if (absl::Now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string TempPath(const std::string& stem) {
  const char* dir = std::getenv("TMPDIR");
  static std::atomic<int> counter{0};
  return absl::StrCat(dir != nullptr && *dir != '\0' ? dir : "/tmp", "/mlakv-e2e-", getpid(), "-", counter++, "-",
                      stem);
}

}  // namespace

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string CommandResult::Describe() const {
  return absl::StrCat("exit ", exit_code, timed_out ? " (timed out)" : "", "\n--- stdout ---\n", out,
                      "\n--- stderr ---\n", err);
}

CommandResult RunCommand(const std::vector<std::string>& argv, absl::Duration timeout) {
  const std::string out_path = TempPath("out"), err_path = TempPath("err");
  CommandResult result;
  const pid_t pid = Spawn(argv, out_path, err_path);
  if (pid < 0) {
    result.err = absl::StrCat("fork failed for ", absl::StrJoin(argv, " "));
    return result;
  }
  std::optional<int> code = WaitFor(pid, timeout);
  if (!code) {
    kill(pid, SIGKILL);
    WaitFor(pid, absl::Seconds(10));
    result.timed_out = true;
  } else {
    result.exit_code = *code;
  }
  result.out = ReadFileOrEmpty(out_path);
  result.err = ReadFileOrEmpty(err_path);
  unlink(out_path.c_str());
  unlink(err_path.c_str());
  return result;
}

std::optional<ChildProcess> ChildProcess::Start(const std::vector<std::string>& argv, const std::string& log_path) {
  const pid_t pid = Spawn(argv, log_path, log_path);
  if (pid < 0) return std::nullopt;
  return ChildProcess(pid);
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept : pid_(other.pid_), ended_(other.ended_) {
  other.pid_ = -1;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !ended_) Stop(absl::Seconds(5));
}

std::optional<int> ChildProcess::Poll() {
  if (!ended_ && pid_ > 0) ended_ = WaitFor(pid_, absl::ZeroDuration());
  return ended_;
}

ChildProcess::Ending ChildProcess::Stop(absl::Duration grace) {
  Ending ending;
  if (pid_ <= 0) return ending;
  if (!Poll()) {
    kill(pid_, SIGTERM);
    ended_ = WaitFor(pid_, grace);
    if (!ended_) {
      kill(pid_, SIGKILL);
      ending.killed = true;
      ended_ = WaitFor(pid_, absl::Seconds(10)).value_or(-1);
    }
  }
  ending.code = *ended_;
  return ending;
}

}  // namespace mlakv::e2e
