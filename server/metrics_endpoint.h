// MetricsEndpoint: GET /metrics in the Prometheus text format, served by
// civetweb (the HTTP server prometheus-cpp's pull library is built on).
//
// Several connections are served at once (num_threads worker threads), and a
// connection must deliver its whole request head within request_timeout or
// it is dropped (the time counts from accept, so a client dripping a byte at
// a time is dropped too). A client that stalls therefore holds one worker for
// at most request_timeout and never delays the others; only num_threads
// clients stalling at once make a scrape wait, and then at most until the
// first of them times out.
//
// GET and HEAD /metrics answer 200 with kContentType; any other path is 404,
// any other method 405, a malformed request or a head over 8 KiB 400.
// Connections close after each response. Shutdown is prompt even with clients connected.
//
// Why not prometheus::Exposer: it answers "text/plain; charset=utf-8" without
// the format version (prometheus-cpp 1.0.1 through 1.3), answers HEAD and
// other methods 404, and adds its own exposer_* series; the server the
// endpoint runs is the same civetweb either way.
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

class CivetServer;

namespace mlakv::server {

class MetricsEndpoint {
 public:
  struct Options {
    // host:port to listen on ("0.0.0.0:9090", "127.0.0.1:0",
    // "localhost:9090"; an empty host is 0.0.0.0; "[::1]:9090" only where
    // civetweb is built with IPv6, which Debian 12's is not); port 0 picks a
    // free port (see port()). A port already in use is an error: civetweb binds with
    // SO_REUSEADDR only, never SO_REUSEPORT, so it cannot share a port.
    std::string listen;
    // Serialized in this order at every scrape; expired ones are skipped.
    std::vector<std::weak_ptr<prometheus::Collectable>> collectables;
    // Connections served at once (civetweb worker threads).
    int num_threads = 4;
    // Time a connection has to send its request head (and to take the
    // response), counted from accept.
    absl::Duration request_timeout = absl::Seconds(5);
  };

  static constexpr char kContentType[] = "text/plain; version=0.0.4; charset=utf-8";

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
  // Stops accepting, drops connections in progress, joins the threads;
  // returns within milliseconds whatever clients do. Idempotent.
  void Shutdown();

 private:
  class Handler;  // the /metrics request handler (metrics_endpoint.cc)

  MetricsEndpoint() = default;
  // Ends the waits civetweb's threads are in (see Shutdown in the .cc).
  void WakeCivetweb() const;

  std::unique_ptr<Handler> handler_;  // outlives server_, which calls it
  absl::Mutex mu_;
  std::unique_ptr<CivetServer> server_ ABSL_GUARDED_BY(mu_);
  int port_ = 0;
  // The listening address with the bound port; a wildcard address replaced
  // by the loopback one, so that a connect() to it reaches the listener.
  sockaddr_storage local_{};
  bool wildcard_ = false;  // listening on 0.0.0.0 / ::
};

}  // namespace mlakv::server
