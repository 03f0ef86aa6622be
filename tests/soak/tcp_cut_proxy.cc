#include "tests/soak/tcp_cut_proxy.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace mlakv::soak {
namespace {

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat("tcp cut proxy: ", what, ": ", std::strerror(errno)));
}

// A connected socket to `target` ("host:port"), or -1.
int ConnectTo(const std::string& target) {
  const size_t colon = target.rfind(':');
  if (colon == std::string::npos) return -1;
  std::string host = target.substr(0, colon);
  if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), target.substr(colon + 1).c_str(), &hints, &found) != 0) return -1;
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd >= 0 && connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd >= 0) {
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  return fd;
}

// Closes with a RST instead of a FIN.
void Reset(int fd) {
  const linger hard{.l_onoff = 1, .l_linger = 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &hard, sizeof(hard));
  close(fd);
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpCutProxy>> TcpCutProxy::Create(const std::string& upstream) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 8) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const absl::Status s = Errno("bind/listen on 127.0.0.1:0");
    close(fd);
    return s;
  }
  int wake[2];
  if (pipe2(wake, O_CLOEXEC) != 0) {
    close(fd);
    return Errno("pipe");
  }
  return std::unique_ptr<TcpCutProxy>(
      new TcpCutProxy(fd, wake[0], wake[1], upstream, absl::StrCat("127.0.0.1:", ntohs(addr.sin_port))));
}

TcpCutProxy::TcpCutProxy(int listen_fd, int wake_read, int wake_write, std::string upstream, std::string target)
    : listen_fd_(listen_fd),
      wake_read_(wake_read),
      wake_write_(wake_write),
      upstream_(std::move(upstream)),
      target_(std::move(target)) {
  thread_ = std::thread([this] { Loop(); });
}

TcpCutProxy::~TcpCutProxy() {
  Cut();
  thread_.join();
  close(listen_fd_);
  close(wake_read_);
  close(wake_write_);
}

void TcpCutProxy::Cut() {
  if (cut_.exchange(true)) return;
  const char byte = 0;
  [[maybe_unused]] const ssize_t n = write(wake_write_, &byte, 1);
}

bool TcpCutProxy::Pump(int from, int to) {
  char buffer[64 << 10];
  const ssize_t n = read(from, buffer, sizeof(buffer));
  if (n <= 0) return false;
  for (ssize_t sent = 0; sent < n;) {
    const ssize_t w = write(to, buffer + sent, n - sent);  // blocking: backpressure reaches the sender
    if (w <= 0) return false;
    sent += w;
  }
  return true;
}

void TcpCutProxy::Loop() {
  std::vector<std::pair<int, int>> pairs;
  while (!cut_.load()) {
    std::vector<pollfd> fds = {{wake_read_, POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    for (auto [a, b] : pairs) {
      fds.push_back({a, POLLIN, 0});
      fds.push_back({b, POLLIN, 0});
    }
    if (poll(fds.data(), fds.size(), 1000) < 0 && errno != EINTR) break;
    if (cut_.load()) break;
    // The pairs polled above first (fds holds exactly them); a connection
    // accepted below joins the next poll.
    size_t polled = pairs.size();
    for (size_t i = 0; i < polled;) {
      const pollfd& a = fds[2 + 2 * i];
      const pollfd& b = fds[3 + 2 * i];
      bool alive = true;
      if (a.fd == pairs[i].first && (a.revents & (POLLIN | POLLHUP | POLLERR))) alive = Pump(a.fd, pairs[i].second);
      if (alive && b.fd == pairs[i].second && (b.revents & (POLLIN | POLLHUP | POLLERR))) {
        alive = Pump(b.fd, pairs[i].first);
      }
      if (!alive) {
        Reset(pairs[i].first);
        Reset(pairs[i].second);
        pairs.erase(pairs.begin() + i);
        fds.erase(fds.begin() + 2 + 2 * i, fds.begin() + 4 + 2 * i);
        --polled;
      } else {
        ++i;
      }
    }
    if (fds[1].revents & POLLIN) {
      const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client >= 0) {
        const int server = ConnectTo(upstream_);
        if (server < 0) {
          Reset(client);
        } else {
          pairs.emplace_back(client, server);
        }
      }
    }
  }
  for (auto [a, b] : pairs) {
    Reset(a);
    Reset(b);
  }
}

}  // namespace mlakv::soak
