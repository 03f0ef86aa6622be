// TcpCutProxy: a loopback TCP forwarder to the server that can sever its
// connections at once (SO_LINGER 0: a RST both ways), so a fault can end a
// stream the way a crashed client or a dead network does: no RST_STREAM, no
// half-close, the connection just dies under the call.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace mlakv::soak {

class TcpCutProxy {
 public:
  // Listens on 127.0.0.1:0 and forwards every connection to `upstream` (host:port).
  static absl::StatusOr<std::unique_ptr<TcpCutProxy>> Create(const std::string& upstream);
  ~TcpCutProxy();
  TcpCutProxy(const TcpCutProxy&) = delete;
  TcpCutProxy& operator=(const TcpCutProxy&) = delete;

  // "127.0.0.1:PORT" to point a channel at.
  const std::string& target() const { return target_; }
  // Resets every connection (both sides) and stops forwarding.
  void Cut();

 private:
  TcpCutProxy(int listen_fd, int wake_read, int wake_write, std::string upstream, std::string target);
  void Loop();
  // Copies what `from` has to `to`; false when either side is done.
  static bool Pump(int from, int to);

  const int listen_fd_;
  const int wake_read_, wake_write_;  // a pipe that wakes the loop for Cut
  const std::string upstream_;
  const std::string target_;
  std::atomic<bool> cut_{false};
  std::thread thread_;  // Loop: accepts, forwards, and on Cut resets every connection
};

}  // namespace mlakv::soak
