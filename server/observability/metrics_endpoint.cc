#include "server/observability/metrics_endpoint.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <system_error>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "civetweb.h"
#include "common/quote.h"
#include "common/status_macros.h"
#include "prometheus/exposer.h"

namespace mlakv::server {
namespace {

constexpr char kPath[] = "/metrics";
constexpr int kMaxRequestHeadBytes = 8192;

struct ListenAddress {
  std::string civetweb;  // "1.2.3.4:9090" or "[::1]:9090", civetweb's listening_ports syntax
  sockaddr_storage addr{};  // the same; a wildcard address replaced by loopback
};

// Resolves "host:port" to one numeric address. civetweb takes only numeric
// addresses and reads suffixes ("9090s" is TLS, "9090r" a redirect, commas
// separate several ports), so the string it gets is always built here.
absl::StatusOr<ListenAddress> Resolve(const std::string& listen) {
  const absl::Status bad = absl::InvalidArgumentError(
      absl::StrCat(Quote(listen), " is not host:port (e.g. 0.0.0.0:9090, 127.0.0.1:0, [::1]:9090)"));
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
    return absl::InvalidArgumentError(absl::StrCat(Quote(listen), ": cannot resolve the host",
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
    if (IN6_IS_ADDR_UNSPECIFIED(&a->sin6_addr)) a->sin6_addr = in6addr_loopback;
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&out.addr);
    inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
    out.civetweb = absl::StrCat(text, ":", port_number);
    if (a->sin_addr.s_addr == htonl(INADDR_ANY)) a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  }
  return out;
}

void SetPort(sockaddr_storage& a, int port) {
  if (a.ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6&>(a).sin6_port = htons(static_cast<uint16_t>(port));
  } else {
    reinterpret_cast<sockaddr_in&>(a).sin_port = htons(static_cast<uint16_t>(port));
  }
}

socklen_t LengthOf(const sockaddr_storage& a) {
  return a.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

// A connection to `to` that is closed at once: it makes the listening
// socket readable, which ends the acceptor's poll. The worker that gets it
// reads EOF and is done.
void Knock(const sockaddr_storage& to) {
  if (int fd = socket(to.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0); fd >= 0) {
    connect(fd, reinterpret_cast<const sockaddr*>(&to), LengthOf(to));
    close(fd);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Create(Options options) {
  if (options.num_threads < 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics endpoint: num_threads ", options.num_threads, " < 1"));
  }
  const int64_t timeout_ms = absl::ToInt64Milliseconds(options.request_timeout);
  if (timeout_ms < 1) return absl::InvalidArgumentError("metrics endpoint: request_timeout must be >= 1 ms");
  MLAKV_ASSIGN_OR_RETURN(ListenAddress address, Resolve(options.listen));

  std::vector<std::string> civetweb_options = {
      "listening_ports", address.civetweb,
      "num_threads", std::to_string(options.num_threads),
      "request_timeout_ms", std::to_string(timeout_ms),
      "enable_keep_alive", "no",
      "max_request_size", std::to_string(kMaxRequestHeadBytes),
  };
  // The Exposer's CivetServer reports a failed start (bind) by throwing
  // CivetException; nothing of it may escape into the server's start-up.
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    exposer = std::make_unique<prometheus::Exposer>(std::move(civetweb_options));
  } catch (const std::exception& ex) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", Quote(options.listen), " (as ", address.civetweb,
                                               "; address in use, or not on this host?): ", ex.what()));
  }
  const std::vector<int> ports = exposer->GetListeningPorts();
  if (ports.size() != 1 || ports[0] <= 0) {
    return absl::InternalError(absl::StrCat("metrics endpoint on ", Quote(options.listen), ": civetweb reports ",
                                            ports.size(), " listening ports"));
  }
  // Registered one by one, so scrapes list them in this order. The Exposer
  // adds the /metrics handler with the first collectable registered; an
  // empty (expired) one, which every scrape skips, gives an endpoint without
  // collectables its handler too, so that it still answers with the
  // Exposer's own series rather than 404.
  if (options.collectables.empty()) exposer->RegisterCollectable(std::weak_ptr<prometheus::Collectable>(), kPath);
  for (const auto& collectable : options.collectables) exposer->RegisterCollectable(collectable, kPath);

  std::unique_ptr<MetricsEndpoint> e(new MetricsEndpoint());
  e->port_ = ports[0];
  e->local_ = address.addr;
  SetPort(e->local_, e->port_);
  {
    absl::MutexLock lock(&e->mu_);
    e->exposer_ = std::move(exposer);
  }
  return e;
}

MetricsEndpoint::~MetricsEndpoint() { Shutdown(); }

// Destroying the Exposer stops civetweb (mg_stop): it sets the stop flag and
// joins the acceptor, which looks at the flag only when its poll of the
// listening socket returns, at the latest after 2 s. While the Exposer is
// being destroyed, a second thread therefore knocks on the listener every
// few milliseconds (a knock that lands before the flag is set is accepted,
// and the acceptor polls again; the next knock ends that poll too). The
// workers are woken by mg_stop itself when idle; one that is polling a
// stalled client sees the flag when its poll ends (up to 2 s).
void MetricsEndpoint::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (exposer_ == nullptr) return;
  std::atomic<bool> stopped{false};
  std::thread waker;
  try {
    waker = std::thread([this, &stopped] {
      while (!stopped.load()) {
        Knock(local_);
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
  } catch (const std::system_error&) {
    // No thread: the stop below is correct, only up to 2 s slower.
  }
  exposer_.reset();
  stopped.store(true);
  if (waker.joinable()) waker.join();
}

}  // namespace mlakv::server
