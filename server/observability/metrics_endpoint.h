// MetricsEndpoint: GET /metrics in the Prometheus text format, served by
// prometheus-cpp's prometheus::Exposer (prometheus-cpp pull, on civetweb).
//
// What this class adds to the Exposer: the listen address resolved to the
// numeric form civetweb needs, civetweb options for several connections and
// a request timeout, errors as absl::Status instead of exceptions, and a
// shutdown that does not sit out civetweb's 2 s accept poll.
//
// Several connections are served at once (num_threads worker threads), and a
// connection must deliver its whole request head within request_timeout or
// it is dropped (the time counts from accept, so a client dripping a byte at
// a time is dropped too). A client that stalls therefore holds one worker for
// at most request_timeout and never delays the others; only num_threads
// clients stalling at once make a scrape wait, and then at most until the
// first of them times out. Connections close after each response.
//
// What the Exposer answers (prometheus-cpp 1.0.1, civetweb 1.15, Debian 12;
// metrics_endpoint_test checks each):
//   * GET on /metrics, or on any path that begins with it (civetweb matches a
//     handler's URI as a prefix: /metrics/x, /metricsx): 200, "Content-Type:
//     text/plain; charset=utf-8". No version parameter: Prometheus reads a
//     text/plain answer without one as the text format 0.0.4, which this is.
//     Gzipped when the request accepts gzip. Other paths: 404.
//   * The body starts with the Exposer's own series (exposer_scrapes_total,
//     exposer_transferred_bytes_total, exposer_request_latencies), then the
//     collectables in the order given.
//   * Only GET is handled. civetweb answers the rest as a file server with no
//     document root: HEAD, POST, OPTIONS 404; PUT, DELETE, PATCH 405. A
//     malformed request or a head over 8 KiB: 400.
//   * Concurrent scrapes are served on different workers, but the Exposer
//     calls the collectables under one mutex, so their collections run one
//     after another (ServerMetrics' take well under a millisecond).
//   * A collectable that throws: nothing catches the exception (the Exposer
//     does not, and it goes on through civetweb's C code), so the process
//     ends. The collectables of ServerMetrics do not throw (beyond running
//     out of memory).
//
// Shutdown: civetweb (1.15) looks at its stop flag only between polls of up
// to 2 s (SOCKET_TIMEOUT_QUANTUM): the acceptor's poll of the listening
// socket, and each worker's poll of a connection that has not sent its
// request yet. Shutdown ends the acceptor's poll at once (see the .cc), so
// an idle endpoint, or one whose clients send whole requests, stops in
// milliseconds. A client stalled mid-request at that moment holds its
// worker until that worker's current poll ends: stopping can then take up
// to 2 s more. The endpoint does not reach into civetweb's connections to
// cut that short: civetweb gives no handle on their sockets, and hunting
// for them among the process's descriptors is not worth up to 2 s.
#pragma once

#include <sys/socket.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/collectable.h"

namespace prometheus {
class Exposer;
}

namespace mlakv::server {

class MetricsEndpoint {
 public:
  struct Options {
    // host:port to listen on ("0.0.0.0:9090", "127.0.0.1:0",
    // "localhost:9090"; an empty host is 0.0.0.0; "[::1]:9090" only where
    // civetweb is built with IPv6, which Debian 12's is not); port 0 picks a
    // free port (see port()). A port already in use is an error: civetweb
    // binds with SO_REUSEADDR only, never SO_REUSEPORT, so it cannot share a
    // port.
    std::string listen;
    // Serialized in this order at every scrape, after the Exposer's own
    // series; expired ones are skipped. They must not throw (see above).
    std::vector<std::weak_ptr<prometheus::Collectable>> collectables;
    // Connections served at once (civetweb worker threads).
    int num_threads = 4;
    // Time a connection has to send its request head (and to take the
    // response), counted from accept.
    absl::Duration request_timeout = absl::Seconds(5);
  };

  // Binds, listens and starts the worker threads. Errors: InvalidArgument for
  // an address that is not host:port or does not resolve, num_threads < 1 or
  // a non-positive timeout; Unavailable ("cannot listen on '...'") when
  // civetweb cannot bind (port in use, address not on this host).
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Create(Options options);
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  // The bound port (the one picked when 0 was asked).
  int port() const { return port_; }
  // Stops accepting and joins civetweb's threads: in milliseconds, unless a
  // client is stalled mid-request (then up to 2 s more; see above).
  // Idempotent.
  void Shutdown();

 private:
  MetricsEndpoint() = default;

  absl::Mutex mu_;
  std::unique_ptr<prometheus::Exposer> exposer_ ABSL_GUARDED_BY(mu_);
  int port_ = 0;
  // The listening address with the bound port; a wildcard address replaced
  // by the loopback one, so that a connect() to it reaches the listener.
  sockaddr_storage local_{};
};

}  // namespace mlakv::server
