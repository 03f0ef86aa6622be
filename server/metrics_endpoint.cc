#include "server/metrics_endpoint.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <system_error>
#include <thread>

#include "CivetServer.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace mlakv::server {
namespace {

constexpr char kPath[] = "/metrics";
constexpr int kMaxRequestHeadBytes = 8192;

struct ListenAddress {
  std::string civetweb;  // "1.2.3.4:9090" or "[::1]:9090", civetweb's listening_ports syntax
  sockaddr_storage addr{};
  bool wildcard = false;
};

// Resolves "host:port" to one numeric address. civetweb takes only numeric
// addresses and reads suffixes ("9090s" is TLS, "9090r" a redirect, commas
// separate several ports), so the string it gets is always built here.
absl::StatusOr<ListenAddress> Resolve(const std::string& listen) {
  const absl::Status bad = absl::InvalidArgumentError(
      absl::StrCat("'", listen, "' is not host:port (e.g. 0.0.0.0:9090, 127.0.0.1:0, [::1]:9090)"));
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) return bad;
  std::string host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  int port_number = 0;
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(port, &port_number) || port_number > 65535) {
    return bad;
  }
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host.empty()) host = "0.0.0.0";
  addrinfo hints{};
  // Bit 8 of mg_check_feature: civetweb built with IPv6 (Debian 12's is not).
  const bool ipv6 = mg_check_feature(8) != 0;
  hints.ai_family = ipv6 ? AF_UNSPEC : AF_INET;  // "localhost" then means 127.0.0.1
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (int gai = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); gai != 0 || res == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("'", listen, "': cannot resolve the host",
                                                   ipv6 ? "" : " to an IPv4 address (this civetweb has no IPv6)",
                                                   ": ", gai_strerror(gai)));
  }
  ListenAddress out;
  std::memcpy(&out.addr, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  char text[INET6_ADDRSTRLEN] = {};
  if (out.addr.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&out.addr);
    inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof(text));
    out.civetweb = absl::StrCat("[", text, "]:", port_number);
    out.wildcard = IN6_IS_ADDR_UNSPECIFIED(&a->sin6_addr);
    if (out.wildcard) a->sin6_addr = in6addr_loopback;
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&out.addr);
    inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
    out.civetweb = absl::StrCat(text, ":", port_number);
    out.wildcard = a->sin_addr.s_addr == htonl(INADDR_ANY);
    if (out.wildcard) a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  }
  return out;
}

int PortOf(const sockaddr_storage& a) {
  return ntohs(a.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6&>(a).sin6_port
                                       : reinterpret_cast<const sockaddr_in&>(a).sin_port);
}

void SetPort(sockaddr_storage& a, int port) {
  if (a.ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6&>(a).sin6_port = htons(static_cast<uint16_t>(port));
  } else {
    reinterpret_cast<sockaddr_in&>(a).sin_port = htons(static_cast<uint16_t>(port));
  }
}

bool SameHost(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<const sockaddr_in6&>(a).sin6_addr,
                       &reinterpret_cast<const sockaddr_in6&>(b).sin6_addr, sizeof(in6_addr)) == 0;
  }
  return reinterpret_cast<const sockaddr_in&>(a).sin_addr.s_addr ==
         reinterpret_cast<const sockaddr_in&>(b).sin_addr.s_addr;
}

socklen_t LengthOf(const sockaddr_storage& a) {
  return a.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

}  // namespace

// Runs on civetweb's worker threads, several at once; nothing here throws
// into civetweb (C code): a collectable that throws answers 500.
class MetricsEndpoint::Handler : public CivetHandler {
 public:
  explicit Handler(std::vector<std::weak_ptr<prometheus::Collectable>> collectables)
      : collectables_(std::move(collectables)) {}

  bool handleGet(CivetServer*, mg_connection* conn) override { return Serve(conn, /*with_body=*/true); }
  bool handleHead(CivetServer*, mg_connection* conn) override { return Serve(conn, /*with_body=*/false); }
  bool handlePost(CivetServer*, mg_connection* conn) override { return MethodNotAllowed(conn); }
  bool handlePut(CivetServer*, mg_connection* conn) override { return MethodNotAllowed(conn); }
  bool handleDelete(CivetServer*, mg_connection* conn) override { return MethodNotAllowed(conn); }
  bool handleOptions(CivetServer*, mg_connection* conn) override { return MethodNotAllowed(conn); }
  bool handlePatch(CivetServer*, mg_connection* conn) override { return MethodNotAllowed(conn); }

 private:
  // civetweb also hands "/metrics/..." to the handler of "/metrics".
  static bool IsMetricsPath(mg_connection* conn) {
    const mg_request_info* info = mg_get_request_info(conn);
    return info != nullptr && info->local_uri != nullptr && std::strcmp(info->local_uri, kPath) == 0;
  }

  bool Serve(mg_connection* conn, bool with_body) const {
    if (!IsMetricsPath(conn)) {
      mg_send_http_error(conn, 404, "%s", "Not Found");
      return true;
    }
    std::string body;
    try {
      std::vector<prometheus::MetricFamily> families;
      for (const auto& weak : collectables_) {
        if (std::shared_ptr<prometheus::Collectable> c = weak.lock()) {
          for (prometheus::MetricFamily& f : c->Collect()) families.push_back(std::move(f));
        }
      }
      body = prometheus::TextSerializer().Serialize(families);
    } catch (const std::exception& e) {
      mg_send_http_error(conn, 500, "collecting metrics failed: %s", e.what());
      return true;
    }
    mg_send_http_ok(conn, kContentType, static_cast<long long>(body.size()));
    if (with_body) mg_write(conn, body.data(), body.size());
    return true;
  }

  static bool MethodNotAllowed(mg_connection* conn) {
    if (!IsMetricsPath(conn)) {
      mg_send_http_error(conn, 404, "%s", "Not Found");
      return true;
    }
    mg_response_header_start(conn, 405);
    mg_response_header_add(conn, "Allow", "GET, HEAD", -1);
    mg_response_header_add(conn, "Content-Length", "0", -1);
    mg_response_header_send(conn);
    return true;
  }

  const std::vector<std::weak_ptr<prometheus::Collectable>> collectables_;
};

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Create(Options options) {
  if (options.num_threads < 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics endpoint: num_threads ", options.num_threads, " < 1"));
  }
  const int64_t timeout_ms = absl::ToInt64Milliseconds(options.request_timeout);
  if (timeout_ms < 1) return absl::InvalidArgumentError("metrics endpoint: request_timeout must be >= 1 ms");
  MLAKV_ASSIGN_OR_RETURN(ListenAddress address, Resolve(options.listen));

  std::unique_ptr<MetricsEndpoint> e(new MetricsEndpoint());
  e->handler_ = std::make_unique<Handler>(std::move(options.collectables));
  e->local_ = address.addr;
  e->wildcard_ = address.wildcard;
  const std::vector<std::string> civetweb_options = {
      "listening_ports", address.civetweb,
      "num_threads", std::to_string(options.num_threads),
      "request_timeout_ms", std::to_string(timeout_ms),
      "enable_keep_alive", "no",
      "max_request_size", std::to_string(kMaxRequestHeadBytes),
  };
  // CivetServer reports a failed start (bind) by throwing CivetException.
  // Declared after `e`, so that on an error it stops before the handler goes.
  std::unique_ptr<CivetServer> server;
  try {
    server = std::make_unique<CivetServer>(civetweb_options);
  } catch (const std::exception& ex) {
    return absl::UnavailableError(absl::StrCat("cannot listen on '", options.listen, "' (as ", address.civetweb,
                                               "; address in use, or not on this host?): ", ex.what()));
  }
  server->addHandler(kPath, e->handler_.get());
  const std::vector<int> ports = server->getListeningPorts();
  if (ports.size() != 1 || ports[0] <= 0) {
    return absl::InternalError(absl::StrCat("metrics endpoint on '", options.listen, "': civetweb reports ",
                                            ports.size(), " listening ports"));
  }
  e->port_ = ports[0];
  SetPort(e->local_, e->port_);
  {
    absl::MutexLock lock(&e->mu_);
    e->server_ = std::move(server);
  }
  return e;
}

MetricsEndpoint::~MetricsEndpoint() { Shutdown(); }

// civetweb (1.15) looks at its stop flag only between polls of up to 2 s
// (SOCKET_TIMEOUT_QUANTUM in civetweb.c): the acceptor's poll of the
// listening socket and each worker's poll of a client that has not sent its
// request yet. mg_stop alone therefore takes up to 2 s even with nobody
// connected. While it runs, a second thread wakes those polls until it
// returns: a throwaway connection makes the listening socket readable, and
// shutdown() of the server side of each open connection makes its socket
// readable (EOF). The flag is then seen at once.
void MetricsEndpoint::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (server_ == nullptr) return;
  std::atomic<bool> stopped{false};
  std::thread waker;
  try {
    waker = std::thread([this, &stopped] {
      while (!stopped.load()) {
        WakeCivetweb();
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
  } catch (const std::system_error&) {
    // No thread: the stop below is correct, only slower.
  }
  server_->close();
  stopped.store(true);
  if (waker.joinable()) waker.join();
  server_.reset();
}

void MetricsEndpoint::WakeCivetweb() const {
  // The acceptor: a connection that is closed at once (a worker that gets
  // it before the stop flag is set reads EOF and is done).
  if (int fd = socket(local_.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0); fd >= 0) {
    connect(fd, reinterpret_cast<const sockaddr*>(&local_), LengthOf(local_));
    close(fd);
  }
  // The workers: civetweb gives no access to its connections' sockets, so
  // they are found among this process's descriptors as the connected TCP
  // sockets whose local end is this endpoint's address and port. Each is
  // inspected through a duplicate of its descriptor: if civetweb closes the
  // original meanwhile and the number is reused, the duplicate still refers
  // to the socket that was checked, so nothing else is ever shut down.
  // shutdown() does not close anything; civetweb still closes its socket.
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return;
  const int dir_fd = dirfd(dir);
  while (dirent* entry = readdir(dir)) {
    int fd = 0;
    if (!absl::SimpleAtoi(entry->d_name, &fd) || fd == dir_fd) continue;
    const int dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) continue;
    sockaddr_storage local{}, peer{};
    socklen_t local_len = sizeof(local), peer_len = sizeof(peer);
    if (getsockname(dup, reinterpret_cast<sockaddr*>(&local), &local_len) == 0 &&
        (local.ss_family == AF_INET || local.ss_family == AF_INET6) && PortOf(local) == port_ &&
        (wildcard_ || SameHost(local, local_)) &&
        getpeername(dup, reinterpret_cast<sockaddr*>(&peer), &peer_len) == 0) {
      shutdown(dup, SHUT_RDWR);
    }
    close(dup);
  }
  closedir(dir);
}

}  // namespace mlakv::server
