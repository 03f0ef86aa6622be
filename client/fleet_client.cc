#include "client/fleet_client.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/rendezvous.h"
#include "common/quote.h"
#include "common/status_macros.h"

namespace mlakv {
namespace {

// How long a refused connection keeps a channel in backoff at most: a
// server that comes back is found by the next probe after this.
constexpr absl::Duration kMaxReconnectBackoff = absl::Seconds(2);

// "server ID (ADDRESS)", or "server ADDRESS" while its id is unknown.
std::string DescribeServer(const std::string& server_id, const std::string& address) {
  if (server_id.empty() || server_id == address) return absl::StrCat("server ", address);
  return absl::StrCat("server ", server_id, " (", address, ")");
}

}  // namespace

absl::StatusOr<std::unique_ptr<FleetClient>> FleetClient::Create(Options options) {
  if (options.servers.servers.empty() && !options.servers.uses_dns()) {
    return absl::InvalidArgumentError("fleet: no servers given (a list, or dns:///NAME:PORT)");
  }
  if (options.probe_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("fleet: probe_timeout must be positive");
  }
  if (options.refresh_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("fleet: refresh_interval must not be negative");
  }
  if (options.max_recorded_owners == 0) return absl::InvalidArgumentError("fleet: max_recorded_owners must be positive");
  if (options.servers.uses_dns() && !options.resolver) options.resolver = SystemResolver();
  options.client.max_reconnect_backoff = kMaxReconnectBackoff;
  std::unique_ptr<FleetClient> fleet(new FleetClient(std::move(options)));
  MLAKV_RETURN_IF_ERROR(fleet->Start());
  return fleet;
}

FleetClient::FleetClient(Options options) : options_(std::move(options)) {}

FleetClient::~FleetClient() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (refresher_.joinable()) refresher_.join();
}

absl::Status FleetClient::Start() {
  // A name that does not resolve yet is not an error: the Service may have
  // no ready pod; calls fail UNAVAILABLE until one appears.
  absl::StatusOr<std::vector<std::string>> addresses = CurrentAddresses();
  if (addresses.ok()) MLAKV_RETURN_IF_ERROR(SyncMembers(*addresses));
  ProbeAll();
  if (options_.refresh_interval > absl::ZeroDuration()) refresher_ = std::thread([this] { RefreshLoop(); });
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> FleetClient::CurrentAddresses() const {
  if (!options_.servers.uses_dns()) return options_.servers.servers;
  MLAKV_ASSIGN_OR_RETURN(std::vector<std::string> ips, options_.resolver(options_.servers.dns_name));
  std::vector<std::string> addresses;
  addresses.reserve(ips.size());
  for (const std::string& ip : ips) addresses.push_back(JoinHostPort(ip, options_.servers.port));
  return addresses;
}

absl::Status FleetClient::SyncMembers(const std::vector<std::string>& addresses) {
  std::vector<std::pair<std::string, std::shared_ptr<KvCacheClient>>> added;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const std::string& address : addresses) {
      if (servers_.contains(address)) continue;
      KvCacheClient::Options o = options_.client;
      o.target = address;
      MLAKV_ASSIGN_OR_RETURN(std::unique_ptr<KvCacheClient> client, KvCacheClient::Create(o));
      added.emplace_back(address, std::move(client));
    }
  }
  absl::MutexLock lock(&mu_);
  for (auto& [address, client] : added) {
    auto server = std::make_shared<Server>();
    server->address = address;
    server->client = std::move(client);
    servers_.emplace(address, std::move(server));
  }
  for (auto it = servers_.begin(); it != servers_.end();) {
    if (std::find(addresses.begin(), addresses.end(), it->first) != addresses.end()) {
      ++it;
      continue;
    }
    // Gone from the name's records: its sequences go with it.
    const std::string gone = it->first;
    servers_.erase(it++);
    absl::erase_if(owners_, [&](const auto& entry) { return entry.second == gone; });
  }
  return absl::OkStatus();
}

void FleetClient::Probe(const std::vector<std::shared_ptr<Server>>& servers) {
  std::vector<std::thread> probes;
  probes.reserve(servers.size());
  for (const std::shared_ptr<Server>& server : servers) {
    probes.emplace_back([this, server] {
      // A refused connection leaves the channel in backoff; a probe tries now.
      server->client->ConnectNow(options_.probe_timeout);
      absl::Status health = server->client->CheckHealth(options_.probe_timeout);
      absl::StatusOr<std::vector<v1::Pool>> pools =
          health.ok() ? server->client->ListPools(options_.probe_timeout) : absl::StatusOr<std::vector<v1::Pool>>(health);
      absl::MutexLock lock(&mu_);
      if (!pools.ok()) {
        server->healthy = false;
        server->last_error = pools.status();
        return;
      }
      // Every pool of a server carries its server_id; a server with none
      // (or an older one) is known by its address.
      server->server_id = pools->empty() || pools->front().server_id().empty() ? server->address
                                                                                : pools->front().server_id();
      server->healthy = true;
      server->last_error = absl::OkStatus();
    });
  }
  for (std::thread& t : probes) t.join();
}

void FleetClient::Refresh() {
  if (options_.servers.uses_dns()) {
    absl::StatusOr<std::vector<std::string>> addresses = CurrentAddresses();
    // A failed lookup keeps the servers known: DNS hiccups must not drop a fleet.
    if (addresses.ok()) SyncMembers(*addresses).IgnoreError();
  }
  ProbeAll();
}

void FleetClient::ProbeAll() {
  // Every server, healthy or not: one that died without a call failing is
  // found here before it is given new sequences.
  std::vector<std::shared_ptr<Server>> to_probe;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [address, server] : servers_) to_probe.push_back(server);
  }
  Probe(to_probe);
}

void FleetClient::RefreshLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    const bool stop = mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.refresh_interval);
    if (stop) break;
    mu_.Unlock();
    Refresh();
    mu_.Lock();
  }
}

std::vector<FleetClient::ServerState> FleetClient::Servers() const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<ServerState> out;
  out.reserve(servers_.size());
  for (const auto& [address, server] : servers_) {
    out.push_back(ServerState{.address = address,
                              .server_id = server->server_id,
                              .healthy = server->healthy,
                              .last_error = server->last_error});
  }
  std::sort(out.begin(), out.end(), [](const ServerState& a, const ServerState& b) { return a.address < b.address; });
  return out;
}

std::string FleetClient::Describe(const Server& server) const {
  return DescribeServer(server.server_id, server.address);
}

absl::StatusOr<FleetClient::Route> FleetClient::RouteFor(const std::string& sequence, const std::string& server_id) {
  absl::ReaderMutexLock lock(&mu_);
  const Server* chosen = nullptr;
  if (!server_id.empty()) {
    for (const auto& [address, server] : servers_) {
      if (server->server_id == server_id) chosen = server.get();
    }
    if (chosen == nullptr) {
      return absl::NotFoundError(absl::StrCat("fleet: no server has server_id ", Quote(server_id), " (",
                                              servers_.size(), " server(s) known)"));
    }
  } else if (auto owner = owners_.find(sequence); owner != owners_.end()) {
    chosen = servers_.at(owner->second).get();
  } else {
    // Rendezvous over every server: the first choice if it is healthy, else
    // the best healthy one (and the first choice is named if that one does
    // not have the sequence).
    std::vector<std::string_view> keys;
    std::vector<const Server*> ranked;
    for (const auto& [address, server] : servers_) {
      keys.push_back(address);
      ranked.push_back(server.get());
    }
    if (ranked.empty()) return absl::UnavailableError("fleet: no server known (the name resolved to no address)");
    const Server* first = ranked[static_cast<size_t>(PickRendezvous(sequence, keys))];
    if (first->healthy) {
      return Route{.client = first->client, .address = first->address, .server_id = first->server_id};
    }
    std::vector<std::string_view> healthy_keys;
    std::vector<const Server*> healthy;
    for (size_t i = 0; i < ranked.size(); ++i) {
      if (!ranked[i]->healthy) continue;
      healthy_keys.push_back(keys[i]);
      healthy.push_back(ranked[i]);
    }
    if (healthy.empty()) {
      std::vector<std::string> why;
      for (const auto& [address, server] : servers_) {
        why.push_back(absl::StrCat(Describe(*server), ": ", server->last_error.message()));
      }
      std::sort(why.begin(), why.end());
      return absl::UnavailableError(absl::StrCat("fleet: no server is healthy (", absl::StrJoin(why, "; "), ")"));
    }
    const Server* fallback = healthy[static_cast<size_t>(PickRendezvous(sequence, healthy_keys))];
    return Route{.client = fallback->client,
                 .address = fallback->address,
                 .server_id = fallback->server_id,
                 .first_choice_down =
                     absl::StrCat(Describe(*first), " is not answering: ", first->last_error.message())};
  }
  if (!chosen->healthy) {
    return absl::UnavailableError(absl::StrCat(Describe(*chosen), " owns sequence ", Quote(sequence),
                                               " and is not answering: ", chosen->last_error.message()));
  }
  return Route{.client = chosen->client, .address = chosen->address, .server_id = chosen->server_id};
}

std::optional<std::string> FleetClient::OwnerOf(const std::string& sequence) const {
  absl::ReaderMutexLock lock(&mu_);
  auto owner = owners_.find(sequence);
  if (owner == owners_.end()) return std::nullopt;
  auto server = servers_.find(owner->second);
  if (server == servers_.end()) return std::nullopt;
  return server->second->server_id;
}

void FleetClient::RecordOwner(const std::string& sequence, const std::string& address) {
  auto [it, inserted] = owners_.insert_or_assign(sequence, address);
  if (inserted && owners_.size() > options_.max_recorded_owners) {
    // Make room: any other entry goes (rendezvous still finds it while the
    // set of servers is unchanged).
    for (auto other = owners_.begin(); other != owners_.end(); ++other) {
      if (other->first != sequence) {
        owners_.erase(other);
        break;
      }
    }
  }
}

absl::Status FleetClient::Explain(const Route& route, const std::string& sequence, const absl::Status& status) {
  const std::string who = DescribeServer(route.server_id, route.address);
  if (status.code() == absl::StatusCode::kUnavailable) {
    if (absl::StartsWith(status.message(), who)) return status;
    return absl::UnavailableError(absl::StrCat(who, ": ", status.message()));
  }
  if (status.code() != absl::StatusCode::kNotFound || route.first_choice_down.empty()) return status;
  return absl::UnavailableError(absl::StrCat("sequence ", Quote(sequence), " is not on ",
                                             DescribeServer(route.server_id, route.address),
                                             "; placement's first choice ", route.first_choice_down, " (",
                                             status.message(), ")"));
}

absl::Status FleetClient::Settle(const Route& route, const std::string& sequence, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  auto server = servers_.find(route.address);
  if (status.ok()) {
    if (server != servers_.end()) RecordOwner(sequence, route.address);
    return status;
  }
  if (status.code() == absl::StatusCode::kNotFound) {
    if (auto owner = owners_.find(sequence); owner != owners_.end() && owner->second == route.address) {
      owners_.erase(owner);
    }
    return status;
  }
  if (status.code() != absl::StatusCode::kUnavailable) return status;
  if (server != servers_.end()) {
    server->second->healthy = false;
    server->second->last_error = status;
  }
  return Explain(route, sequence, status);
}

absl::StatusOr<v1::AppendResponse> FleetClient::Append(const AppendRows& append, const std::string& server_id) {
  return OnSequence<v1::AppendResponse>(
      append.sequence, [&](KvCacheClient& c) { return c.Append(append); }, server_id);
}

absl::StatusOr<v1::Sequence> FleetClient::GetSequence(const std::string& pool, const std::string& sequence,
                                                      const GetSequenceOptions& options,
                                                      const std::string& server_id) {
  return OnSequence<v1::Sequence>(
      sequence, [&](KvCacheClient& c) { return c.GetSequence(pool, sequence, options); }, server_id);
}

absl::StatusOr<StoredLayer> FleetClient::ReadLayer(const std::string& pool, const std::string& sequence,
                                                   uint32_t layer, const ReadLayerOptions& options,
                                                   const std::string& server_id) {
  return OnSequence<StoredLayer>(
      sequence, [&](KvCacheClient& c) { return c.ReadLayer(pool, sequence, layer, options); }, server_id);
}

absl::StatusOr<v1::Sequence> FleetClient::Truncate(const std::string& pool, const std::string& sequence,
                                                   uint32_t length, const std::string& server_id) {
  return OnSequence<v1::Sequence>(
      sequence, [&](KvCacheClient& c) { return c.Truncate(pool, sequence, length); }, server_id);
}

absl::StatusOr<v1::FreeSequenceResponse> FleetClient::FreeSequence(const std::string& pool,
                                                                   const std::string& sequence,
                                                                   const std::string& server_id) {
  absl::StatusOr<v1::FreeSequenceResponse> freed = OnSequence<v1::FreeSequenceResponse>(
      sequence, [&](KvCacheClient& c) { return c.FreeSequence(pool, sequence); }, server_id);
  if (freed.ok()) {
    absl::MutexLock lock(&mu_);
    owners_.erase(sequence);
  }
  return freed;
}

absl::StatusOr<v1::Lease> FleetClient::AcquireLease(const std::string& pool, const std::string& sequence,
                                                    const std::string& holder, absl::Duration duration,
                                                    const std::string& server_id) {
  return OnSequence<v1::Lease>(
      sequence, [&](KvCacheClient& c) { return c.AcquireLease(pool, sequence, holder, duration); }, server_id);
}

absl::StatusOr<v1::ForkSequenceResponse> FleetClient::ForkSequence(const std::string& pool, const std::string& source,
                                                                   const std::string& target, uint32_t length,
                                                                   const std::string& server_id) {
  MLAKV_ASSIGN_OR_RETURN(v1::ForkSequenceResponse forked,
                         OnSequence<v1::ForkSequenceResponse>(
                             source, [&](KvCacheClient& c) { return c.ForkSequence(pool, source, target, length); },
                             server_id));
  // The source's owner was just recorded; the target lives beside it.
  absl::MutexLock lock(&mu_);
  if (auto owner = owners_.find(source); owner != owners_.end()) RecordOwner(target, owner->second);
  return forked;
}

template <typename T>
FleetClient::FromEach<T> FleetClient::OnEach(const std::function<absl::StatusOr<T>(KvCacheClient&)>& call) {
  std::vector<Route> servers;
  FromEach<T> out;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [address, server] : servers_) {
      if (server->healthy) {
        servers.push_back(Route{.client = server->client, .address = address, .server_id = server->server_id});
      } else {
        out.failures.push_back(absl::UnavailableError(
            absl::StrCat(Describe(*server), " is not answering: ", server->last_error.message())));
      }
    }
  }
  std::sort(servers.begin(), servers.end(), [](const Route& a, const Route& b) { return a.address < b.address; });
  std::vector<absl::StatusOr<T>> results(servers.size(), absl::UnknownError("not called"));
  std::vector<std::thread> calls;
  calls.reserve(servers.size());
  for (size_t i = 0; i < servers.size(); ++i) {
    calls.emplace_back([&, i] { results[i] = call(*servers[i].client); });
  }
  for (std::thread& t : calls) t.join();
  for (size_t i = 0; i < servers.size(); ++i) {
    const Route& route = servers[i];
    if (results[i].ok()) {
      out.answers.push_back({.server_id = route.server_id, .address = route.address, .value = *std::move(results[i])});
      continue;
    }
    // Settle marks the server unhealthy on UNAVAILABLE; no sequence is involved.
    absl::Status settled = Settle(route, std::string(), results[i].status());
    if (settled.code() != absl::StatusCode::kUnavailable) {
      settled = absl::Status(settled.code(),
                             absl::StrCat(DescribeServer(route.server_id, route.address), ": ", settled.message()));
    }
    out.failures.push_back(settled);
  }
  return out;
}

FleetClient::FromEach<std::vector<v1::Pool>> FleetClient::ListPools() {
  return OnEach<std::vector<v1::Pool>>([](KvCacheClient& c) { return c.ListPools(); });
}

FleetClient::FromEach<std::vector<v1::SequenceSummary>> FleetClient::ListSequences(const std::string& pool) {
  return OnEach<std::vector<v1::SequenceSummary>>([&](KvCacheClient& c) { return c.ListSequences(pool); });
}

}  // namespace mlakv
