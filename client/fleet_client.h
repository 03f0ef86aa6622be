// FleetClient: many mlakv servers (one per GPU) used as one. Each call for a
// sequence goes to the server that owns it; calls that name no sequence go
// to every server and their answers are put together (docs/deploy.md
// "Placement").
//
// Where a call for sequence S goes, in this order:
//   1. the server the caller names (server_id), when given;
//   2. the server this client last saw S on (the owner it recorded when a call
//      for S succeeded there; forgotten when S is freed or the owner answers
//      NOT_FOUND), so that a sequence stays where it was created even after
//      servers join;
//   3. otherwise rendezvous hashing of S over the servers' addresses
//      (client/rendezvous.h): every client that names the servers the same
//      way (the same list, or the same DNS name) picks the same server, and a
//      server joining takes only about 1/N of new sequences. When the first
//      choice is unhealthy the call goes to the best healthy one; should that
//      answer NOT_FOUND, the call fails UNAVAILABLE naming the first choice
//      (the sequence most likely lives there).
// A server that answers UNAVAILABLE (refused connection, drain) is marked
// unhealthy: calls for the sequences it owns fail at once with UNAVAILABLE
// naming it, and it takes no new sequences until a probe finds it serving
// again. Nothing is retried on another server: a sequence's pages live on
// one GPU.
//
// The set of servers is a fixed list or a DNS name resolved to all its
// addresses (a headless Service); a background thread re-resolves the name
// and probes every server every refresh_interval. A server that
// leaves the name's records is dropped with its recorded sequences (a pod
// that left the Service has lost or will lose its cache).
//
// Thread-safe. Each server has one KvCacheClient (one connection).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/kv_cache_client.h"
#include "client/server_set.h"

namespace mlakv {

class FleetClient {
 public:
  struct Options {
    // Deadline, TLS and token of every call; `target` is not used.
    KvCacheClient::Options client{};
    ServerSetSpec servers{};
    // Resolves servers.dns_name; empty: getaddrinfo (SystemResolver).
    HostResolver resolver{};
    // Re-resolve the name and re-probe unhealthy servers this often; zero:
    // only when Refresh() is called.
    absl::Duration refresh_interval = absl::Seconds(5);
    // Deadline of a probe (health check and ListPools).
    absl::Duration probe_timeout = absl::Seconds(2);
    // Sequence owners remembered; beyond it, others are forgotten to make
    // room (those are then placed by rendezvous, which finds them as long as
    // the set of servers has not changed).
    size_t max_recorded_owners = size_t{1} << 20;
  };

  // One server as this client sees it now.
  struct ServerState {
    std::string address{};    // host:port
    std::string server_id{};  // empty until a probe answered
    bool healthy = false;
    absl::Status last_error{};  // why it is unhealthy
  };

  // The server a call goes to.
  struct Route {
    std::shared_ptr<KvCacheClient> client{};
    std::string address{};
    std::string server_id{};
    // Set when placement's first choice was passed over as unhealthy:
    // "server ID (ADDRESS) is not answering: why".
    std::string first_choice_down{};
  };

  // Answers of every server to a call that names no sequence.
  template <typename T>
  struct FromEach {
    struct Answer {
      std::string server_id{};
      std::string address{};
      T value{};
    };
    std::vector<Answer> answers{};
    std::vector<absl::Status> failures{};  // each names its server
  };

  // Resolves and probes every server before returning. Fails only for bad
  // options; servers that do not answer are listed as unhealthy.
  static absl::StatusOr<std::unique_ptr<FleetClient>> Create(Options options);
  ~FleetClient();
  FleetClient(const FleetClient&) = delete;
  FleetClient& operator=(const FleetClient&) = delete;

  // Re-resolves the DNS name (if any) and probes every server now.
  void Refresh();
  std::vector<ServerState> Servers() const;

  // Where a call for `sequence` goes now (see the header comment);
  // UNAVAILABLE naming the server when its owner is unhealthy, or when no
  // server is healthy.
  absl::StatusOr<Route> RouteFor(const std::string& sequence, const std::string& server_id = "");
  // A failed call's status as the caller should see it: UNAVAILABLE names
  // the server; NOT_FOUND from a fallback while placement's first choice is
  // down becomes UNAVAILABLE naming the first choice. (OnSequence applies it;
  // for callers that use a Route's client themselves.)
  static absl::Status Explain(const Route& route, const std::string& sequence, const absl::Status& status);
  // The recorded owner's server_id, if any.
  std::optional<std::string> OwnerOf(const std::string& sequence) const;

  // Runs `call` on the client of the server RouteFor picks, then records or
  // forgets the owner by the result; an UNAVAILABLE result marks the server
  // unhealthy and names it.
  template <typename T>
  absl::StatusOr<T> OnSequence(const std::string& sequence, const std::function<absl::StatusOr<T>(KvCacheClient&)>& call,
                               const std::string& server_id = "") {
    absl::StatusOr<Route> route = RouteFor(sequence, server_id);
    if (!route.ok()) return route.status();
    absl::StatusOr<T> result = call(*route->client);
    if (result.status().code() == absl::StatusCode::kNotFound && !route->first_choice_down.empty()) {
      return Explain(*route, sequence, result.status());
    }
    absl::Status settled = Settle(*route, sequence, result.status());
    if (!settled.ok()) return settled;
    return result;
  }

  // ---- calls for one sequence ----
  absl::StatusOr<v1::AppendResponse> Append(const AppendRows& append, const std::string& server_id = "");
  absl::StatusOr<v1::Sequence> GetSequence(const std::string& pool, const std::string& sequence,
                                           const GetSequenceOptions& options = {}, const std::string& server_id = "");
  absl::StatusOr<StoredLayer> ReadLayer(const std::string& pool, const std::string& sequence, uint32_t layer,
                                        const ReadLayerOptions& options = {}, const std::string& server_id = "");
  absl::StatusOr<v1::Sequence> Truncate(const std::string& pool, const std::string& sequence, uint32_t length,
                                        const std::string& server_id = "");
  // Forgets the owner once the server freed it.
  absl::StatusOr<v1::FreeSequenceResponse> FreeSequence(const std::string& pool, const std::string& sequence,
                                                        const std::string& server_id = "");
  absl::StatusOr<v1::Lease> AcquireLease(const std::string& pool, const std::string& sequence,
                                         const std::string& holder, absl::Duration duration = absl::ZeroDuration(),
                                         const std::string& server_id = "");
  // The target is created on the source's server (it shares the source's
  // pages) and recorded there.
  absl::StatusOr<v1::ForkSequenceResponse> ForkSequence(const std::string& pool, const std::string& source,
                                                        const std::string& target, uint32_t length = 0,
                                                        const std::string& server_id = "");

  // ---- calls that name no sequence: every healthy server ----
  FromEach<std::vector<v1::Pool>> ListPools();
  FromEach<std::vector<v1::SequenceSummary>> ListSequences(const std::string& pool);

 private:
  struct Server {
    std::string address;
    std::shared_ptr<KvCacheClient> client;
    std::string server_id;  // empty until probed
    bool healthy = false;
    absl::Status last_error = absl::UnavailableError("not probed yet");
  };

  explicit FleetClient(Options options);
  absl::Status Start();
  // The addresses the spec names now (resolving the DNS name).
  absl::StatusOr<std::vector<std::string>> CurrentAddresses() const;
  // Adds servers for new addresses, drops those gone (and their owners).
  absl::Status SyncMembers(const std::vector<std::string>& addresses) ABSL_LOCKS_EXCLUDED(mu_);
  // Probes `servers` in parallel (health check + ListPools for the server_id).
  void Probe(const std::vector<std::shared_ptr<Server>>& servers) ABSL_LOCKS_EXCLUDED(mu_);
  void ProbeAll() ABSL_LOCKS_EXCLUDED(mu_);
  // After a call: records, forgets, or marks the server unhealthy.
  absl::Status Settle(const Route& route, const std::string& sequence, const absl::Status& status)
      ABSL_LOCKS_EXCLUDED(mu_);
  void RecordOwner(const std::string& sequence, const std::string& address) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::string Describe(const Server& server) const;
  template <typename T>
  FromEach<T> OnEach(const std::function<absl::StatusOr<T>(KvCacheClient&)>& call);
  void RefreshLoop();

  const Options options_;
  mutable absl::Mutex mu_;
  // By address.
  absl::flat_hash_map<std::string, std::shared_ptr<Server>> servers_ ABSL_GUARDED_BY(mu_);
  // Sequence -> the address of the server it was last seen on.
  absl::flat_hash_map<std::string, std::string> owners_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread refresher_;
};

}  // namespace mlakv
