#include "server/metrics_http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace mlakv::server {
namespace {

std::string Errno() { return std::strerror(errno); }

// Splits "host:port", "[v6]:port"; empty host means any address.
bool SplitHostPort(const std::string& s, std::string* host, std::string* port) {
  size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon + 1 == s.size()) return false;
  *host = s.substr(0, colon);
  *port = s.substr(colon + 1);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  for (char c : *port) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

const char* Reason(int code) {
  switch (code) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 431: return "Request Header Fields Too Large";
    default: return "Error";
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Create(Options options) {
  if (!options.render) return absl::InvalidArgumentError("metrics server: no render function");
  std::string host, port;
  if (!SplitHostPort(options.listen, &host, &port)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen \"", options.listen, "\" is not host:port (e.g. 0.0.0.0:9090)"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  int gai = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
  if (gai != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen ", options.listen, ": cannot resolve host: ", gai_strerror(gai)));
  }
  int fd = -1;
  std::string err;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      err = Errno();
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 16) == 0) break;
    err = Errno();
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("metrics server: cannot listen on ", options.listen, ": ", err));

  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  int bound = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                       : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC | O_NONBLOCK) != 0) {
    std::string e = Errno();
    close(fd);
    return absl::InternalError(absl::StrCat("metrics server: pipe: ", e));
  }
  return std::unique_ptr<MetricsHttpServer>(
      new MetricsHttpServer(std::move(options), fd, bound, pipefd[0], pipefd[1]));
}

MetricsHttpServer::MetricsHttpServer(Options options, int listen_fd, int port, int wake_read, int wake_write)
    : options_(std::move(options)),
      listen_fd_(listen_fd),
      port_(port),
      wake_read_(wake_read),
      wake_write_(wake_write),
      thread_([this] { Run(); }) {}

MetricsHttpServer::~MetricsHttpServer() {
  Shutdown();
  close(listen_fd_);
  close(wake_read_);
  close(wake_write_);
}

void MetricsHttpServer::Shutdown() {
  if (!stopping_.exchange(true)) {
    char c = 1;
    (void)!write(wake_write_, &c, 1);
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void MetricsHttpServer::Run() {
  while (!stopping_.load()) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_read_, POLLIN, 0}};
    int n = poll(fds, 2, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0 || stopping_.load()) return;
    if (fds[0].revents & POLLIN) {
      int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (conn < 0) continue;
      Serve(conn);
      close(conn);
    }
  }
}

void MetricsHttpServer::Serve(int fd) {
  absl::Time deadline = absl::Now() + options_.io_timeout;
  // Waits until fd is ready for `events`; false on timeout, shutdown or error.
  auto wait = [&](short events) {
    for (;;) {
      int ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
      if (ms <= 0) return false;
      pollfd fds[2] = {{fd, events, 0}, {wake_read_, POLLIN, 0}};
      int n = poll(fds, 2, ms);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0 || fds[1].revents != 0) return false;
      return (fds[0].revents & (events | POLLHUP | POLLERR)) != 0;
    }
  };
  auto respond = [&](int code, const std::string& content_type, const std::string& body, bool head,
                     const std::string& extra_headers = "") {
    std::string msg = absl::StrCat("HTTP/1.1 ", code, " ", Reason(code), "\r\nContent-Type: ", content_type,
                                   "\r\nContent-Length: ", body.size(), "\r\n", extra_headers,
                                   "Connection: close\r\n\r\n");
    if (!head) msg += body;
    size_t off = 0;
    deadline = absl::Now() + options_.io_timeout;
    while (off < msg.size()) {
      ssize_t w = send(fd, msg.data() + off, msg.size() - off, MSG_NOSIGNAL);
      if (w > 0) {
        off += static_cast<size_t>(w);
      } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        if (!wait(POLLOUT)) return;
      } else {
        return;
      }
    }
    requests_.fetch_add(1);
  };

  // Read the request head (up to the blank line).
  std::string req;
  size_t head_end = std::string::npos;
  char buf[2048];
  while (head_end == std::string::npos) {
    if (req.size() > options_.max_request_bytes) {
      respond(431, "text/plain", "request head too large\n", false);
      return;
    }
    ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r > 0) {
      req.append(buf, static_cast<size_t>(r));
      head_end = req.find("\r\n\r\n");
      if (head_end == std::string::npos) head_end = req.find("\n\n");
      continue;
    }
    if (r == 0) return;  // closed before a full request
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      if (!wait(POLLIN)) return;
      continue;
    }
    return;
  }
  if (head_end > options_.max_request_bytes) {
    respond(431, "text/plain", "request head too large\n", false);
    return;
  }
  std::string line = req.substr(0, req.find_first_of("\r\n"));
  std::vector<std::string> parts = absl::StrSplit(line, ' ');
  if (parts.size() != 3 || parts[1].empty() || parts[1][0] != '/' || parts[2].rfind("HTTP/1.", 0) != 0) {
    respond(400, "text/plain", "malformed request line\n", false);
    return;
  }
  const std::string& method = parts[0];
  bool head = method == "HEAD";
  if (method != "GET" && !head) {
    respond(405, "text/plain", "only GET and HEAD\n", false, "Allow: GET, HEAD\r\n");
    return;
  }
  std::string path = parts[1].substr(0, parts[1].find('?'));
  if (path != "/metrics") {
    respond(404, "text/plain", "not found; metrics are at /metrics\n", head);
    return;
  }
  respond(200, options_.content_type, options_.render(), head);
}

}  // namespace mlakv::server
