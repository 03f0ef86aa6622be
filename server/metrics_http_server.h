// MetricsHttpServer: a minimal HTTP/1.1 server for Prometheus scrapes.
//
// GET (or HEAD) /metrics answers 200 with the body of Options::render and the
// text-format content type; any other path is 404, any other method 405, a
// request head over max_request_bytes 431, a malformed one 400. Connections
// are served one at a time on the server's own thread and closed after each
// response (Connection: close); a client that stalls is dropped after
// io_timeout. Shutdown (or the destructor) wakes the thread and joins it
// promptly, even with a client connected.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace mlakv::server {

class MetricsHttpServer {
 public:
  struct Options {
    // host:port to listen on ("0.0.0.0:9090", "127.0.0.1:0", "[::]:9090");
    // port 0 picks a free port (see port()).
    std::string listen;
    // Produces the body of GET /metrics; called on the server's thread.
    std::function<std::string()> render;
    // Content-Type of the /metrics body.
    std::string content_type = "text/plain; version=0.0.4; charset=utf-8";
    // Largest request head (request line + headers) accepted, bytes.
    size_t max_request_bytes = 8192;
    // A connection that sends or takes nothing for this long is dropped.
    absl::Duration io_timeout = absl::Seconds(5);
  };

  // Binds, listens and starts the serving thread. Errors: unparsable address,
  // bind/listen failure (the message names the address and errno text).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Create(Options options);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The bound port (useful with port 0).
  int port() const { return port_; }
  // Requests served so far (any status).
  uint64_t requests_served() const { return requests_.load(); }
  // Stops accepting, drops a connection in progress, joins the thread. Idempotent.
  void Shutdown();

 private:
  MetricsHttpServer(Options options, int listen_fd, int port, int wake_read, int wake_write);
  void Run();
  void Serve(int fd);

  const Options options_;
  const int listen_fd_;
  const int port_;
  const int wake_read_, wake_write_;  // self-pipe: Shutdown writes, poll wakes
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> requests_{0};
  std::thread thread_;
};

}  // namespace mlakv::server
