// FleetClient (client/fleet_client.h) against real mlakv-server processes on
// loopback addresses 127.0.0.2, .3 and .4 (a fourth on .5 joins), all on one
// port as the pods behind a headless Service are: placement spreads 3,000
// sequences evenly and each lives only on its owner; a killed server fails
// only its own sequences, fast, with UNAVAILABLE naming it; a server joining
// takes about a quarter of new sequences and moves none of the old. DNS
// discovery goes through an injectable resolver (the machine's resolver is
// never touched).
#include "client/fleet_client.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

#ifndef MLAKV_SERVER_BINARY
#error "MLAKV_SERVER_BINARY must name mlakv-server"
#endif

extern char** environ;

namespace mlakv {
namespace {

constexpr uint32_t kCkvBytes = 512 * 2, kKpeBytes = 64 * 2;

// A port free on 127.0.0.2 now (the servers then bind it on every address;
// one that is taken meanwhile fails that start and the fixture tries another).
int SomeFreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.2", &a.sin_addr);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// One mlakv-server process with a small CPU pool "p" (1 layer, scales set).
class ServerProcess {
 public:
  ServerProcess(std::string ip, int port, std::string id, std::string dir)
      : ip_(std::move(ip)), port_(port), id_(std::move(id)), log_(absl::StrCat(dir, "/", id_, ".log")) {
    config_ = absl::StrCat(dir, "/", id_, ".txtpb");
    std::ofstream(config_) << "pools { name: \"p\" device: \"cpu\" num_layers: 1 page_size: 16 num_pages: 4096 "
                              "max_sequences: 8192 layer_scales { layer: 0 ckv_scale: 1 kpe_scale: 1 } }\n";
  }
  ~ServerProcess() { Kill(); }

  // Starts it and waits for its ready line; false if it exited (port taken).
  bool Start() {
    const std::string listen = absl::StrCat(ip_, ":", port_);
    std::vector<std::string> args = {MLAKV_SERVER_BINARY, "--listen", listen,   "--device", "cpu",
                                     "--server_id",       id_,        "--config", config_};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    const int rc = posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) return false;
    for (int i = 0; i < 400; ++i) {
      if (Slurp(log_).find(" ready: grpc ") != std::string::npos) return true;
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  std::string address() const { return absl::StrCat(ip_, ":", port_); }
  const std::string& ip() const { return ip_; }
  const std::string& id() const { return id_; }
  std::string log() const { return Slurp(log_); }

 private:
  std::string ip_;
  int port_;
  std::string id_;
  std::string log_, config_;
  pid_t pid_ = -1;
};

// What the fake DNS answers for the Service's name.
class FakeDns {
 public:
  void Set(std::vector<std::string> ips) {
    absl::MutexLock l(&mu_);
    ips_ = std::move(ips);
  }
  void Fail(bool fail) {
    absl::MutexLock l(&mu_);
    fail_ = fail;
  }
  HostResolver resolver() {
    return [this](const std::string& name) -> absl::StatusOr<std::vector<std::string>> {
      absl::MutexLock l(&mu_);
      if (name != "mlakv.kv.svc.cluster.local") return absl::UnavailableError("unknown name " + name);
      if (fail_) return absl::UnavailableError("SERVFAIL");
      return ips_;
    };
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> ips_;
  bool fail_ = false;
};

class FleetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / absl::StrCat("mlakv-fleet-test-", getpid());
    std::filesystem::create_directories(dir_);
    for (int attempt = 0; attempt < 8 && servers_.empty(); ++attempt) {
      port_ = SomeFreePort();
      bool all = true;
      for (int i = 2; i <= 4 && all; ++i) {
        servers_.push_back(std::make_unique<ServerProcess>(absl::StrCat("127.0.0.", i), port_,
                                                           absl::StrCat("mlakv-", i), dir_));
        all = servers_.back()->Start();
      }
      if (!all) servers_.clear();
    }
    ASSERT_EQ(servers_.size(), 3u) << "could not start three servers on one port";
  }
  void TearDown() override {
    servers_.clear();
    std::filesystem::remove_all(dir_);
  }

  FleetClient::Options ListOptions() const {
    FleetClient::Options o;
    for (const auto& s : servers_) o.servers.servers.push_back(s->address());
    o.refresh_interval = absl::ZeroDuration();
    o.client.timeout = absl::Seconds(20);
    return o;
  }
  FleetClient::Options DnsOptions() {
    FleetClient::Options o;
    o.servers.dns_name = "mlakv.kv.svc.cluster.local";
    o.servers.port = port_;
    o.resolver = dns_.resolver();
    o.refresh_interval = absl::ZeroDuration();
    o.client.timeout = absl::Seconds(20);
    return o;
  }
  std::vector<std::string> Ips() const {
    std::vector<std::string> ips;
    for (const auto& s : servers_) ips.push_back(s->ip());
    return ips;
  }

  // One row to layer 0 of `sequence` (creating it).
  static absl::Status AppendOne(FleetClient& fleet, const std::string& sequence) {
    static const std::string ckv(kCkvBytes, '\0'), kpe(kKpeBytes, '\0');
    AppendRows a;
    a.pool = "p";
    a.sequence = sequence;
    a.rows = 1;
    a.layers.push_back(LayerBytes{.layer = 0, .ckv = ckv, .kpe = kpe});
    return fleet.Append(a).status();
  }

  // Sequence -> the server_id of every server whose pool lists it.
  static std::map<std::string, std::vector<std::string>> WhereListed(FleetClient& fleet) {
    std::map<std::string, std::vector<std::string>> where;
    FleetClient::FromEach<std::vector<v1::SequenceSummary>> each = fleet.ListSequences("p");
    EXPECT_TRUE(each.failures.empty()) << each.failures.front();
    for (const auto& answer : each.answers) {
      for (const v1::SequenceSummary& s : answer.value) where[s.id()].push_back(answer.server_id);
    }
    return where;
  }

  std::filesystem::path dir_;
  int port_ = 0;
  std::vector<std::unique_ptr<ServerProcess>> servers_;
  FakeDns dns_;
};

TEST_F(FleetTest, ThreeThousandSequencesSpreadEvenlyAndEachLivesOnlyOnItsOwner) {
  absl::StatusOr<std::unique_ptr<FleetClient>> fleet = FleetClient::Create(ListOptions());
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  for (const FleetClient::ServerState& s : (*fleet)->Servers()) {
    EXPECT_TRUE(s.healthy) << s.address << ": " << s.last_error;
    EXPECT_EQ(s.server_id, absl::StrCat("mlakv-", s.address.substr(8, 1))) << s.address;
  }
  constexpr int kSequences = 3000;
  std::map<std::string, int> per_server;
  for (int i = 0; i < kSequences; ++i) {
    const std::string id = absl::StrCat("req-", i);
    ASSERT_TRUE(AppendOne(**fleet, id).ok()) << id;
    std::optional<std::string> owner = (*fleet)->OwnerOf(id);
    ASSERT_TRUE(owner.has_value()) << id;
    ++per_server[*owner];
  }
  ASSERT_EQ(per_server.size(), 3u);
  for (const auto& [server, count] : per_server) {
    EXPECT_NEAR(count, kSequences / 3, kSequences / 3 * 0.15) << server;
  }
  const std::map<std::string, std::vector<std::string>> where = WhereListed(**fleet);
  EXPECT_EQ(where.size(), static_cast<size_t>(kSequences));
  for (const auto& [id, servers] : where) {
    ASSERT_EQ(servers.size(), 1u) << id << " is on " << servers.size() << " servers";
    EXPECT_EQ(servers[0], *(*fleet)->OwnerOf(id)) << id;
  }
  // A second client that recorded nothing places every sequence the same way.
  absl::StatusOr<std::unique_ptr<FleetClient>> other = FleetClient::Create(ListOptions());
  ASSERT_TRUE(other.ok());
  for (int i = 0; i < kSequences; i += 7) {
    const std::string id = absl::StrCat("req-", i);
    absl::StatusOr<v1::Sequence> seq = (*other)->GetSequence("p", id);
    ASSERT_TRUE(seq.ok()) << id << ": " << seq.status();
    EXPECT_EQ(seq->server_id(), *(*fleet)->OwnerOf(id));
  }
  // ListPools asks every server.
  FleetClient::FromEach<std::vector<v1::Pool>> pools = (*fleet)->ListPools();
  EXPECT_TRUE(pools.failures.empty());
  ASSERT_EQ(pools.answers.size(), 3u);
  uint32_t sequences = 0;
  for (const auto& answer : pools.answers) sequences += answer.value.at(0).sequences();
  EXPECT_EQ(sequences, static_cast<uint32_t>(kSequences));
  // A fork lives beside its source (it shares the source's pages) and is recorded there.
  for (int i = 0; i < 20; ++i) {
    const std::string source = absl::StrCat("req-", i), target = absl::StrCat("fork-", i);
    absl::StatusOr<v1::ForkSequenceResponse> forked = (*fleet)->ForkSequence("p", source, target);
    ASSERT_TRUE(forked.ok()) << forked.status();
    EXPECT_EQ(forked->sequence().server_id(), *(*fleet)->OwnerOf(source));
    EXPECT_EQ((*fleet)->OwnerOf(target), (*fleet)->OwnerOf(source));
  }
}

TEST_F(FleetTest, AKilledServerFailsOnlyItsOwnSequencesFastAndNamesIt) {
  absl::StatusOr<std::unique_ptr<FleetClient>> fleet = FleetClient::Create(ListOptions());
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  constexpr int kSequences = 600;
  for (int i = 0; i < kSequences; ++i) ASSERT_TRUE(AppendOne(**fleet, absl::StrCat("s", i)).ok());
  servers_[1]->Kill();  // mlakv-3 on 127.0.0.3
  const std::string dead = servers_[1]->address();

  int failed = 0, served = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kSequences; ++i) {
    const std::string id = absl::StrCat("s", i);
    const bool owned_by_dead = *(*fleet)->OwnerOf(id) == "mlakv-3";
    absl::StatusOr<v1::Sequence> seq = (*fleet)->GetSequence("p", id);
    if (owned_by_dead) {
      ++failed;
      ASSERT_EQ(seq.status().code(), absl::StatusCode::kUnavailable) << id << ": " << seq.status();
      EXPECT_NE(seq.status().message().find("mlakv-3"), std::string::npos) << seq.status();
      EXPECT_NE(seq.status().message().find(dead), std::string::npos) << seq.status();
    } else {
      ++served;
      ASSERT_TRUE(seq.ok()) << id << ": " << seq.status();
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GT(failed, kSequences / 5);
  EXPECT_GT(served, kSequences / 2);
  // Fast: a refused connection, then the server is known dead and its
  // sequences fail without a call (never the 20 s call deadline).
  EXPECT_LT(seconds, 5.0) << failed << " failures took " << seconds << " s";
  // New sequences go to the living servers only.
  for (int i = 0; i < 300; ++i) {
    const std::string id = absl::StrCat("new-", i);
    ASSERT_TRUE(AppendOne(**fleet, id).ok()) << id;
    EXPECT_NE(*(*fleet)->OwnerOf(id), "mlakv-3") << id;
  }
  // ListPools answers with what it has and names what failed.
  FleetClient::FromEach<std::vector<v1::Pool>> pools = (*fleet)->ListPools();
  EXPECT_EQ(pools.answers.size(), 2u);
  ASSERT_EQ(pools.failures.size(), 1u);
  EXPECT_EQ(pools.failures[0].code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(pools.failures[0].message().find(dead), std::string::npos) << pools.failures[0];

  // A client that recorded nothing: the dead server's sequences are looked
  // for on the fallback, and the failure names the dead first choice.
  absl::StatusOr<std::unique_ptr<FleetClient>> fresh = FleetClient::Create(ListOptions());
  ASSERT_TRUE(fresh.ok());
  int named = 0;
  for (int i = 0; i < kSequences; ++i) {
    const std::string id = absl::StrCat("s", i);
    if (*(*fleet)->OwnerOf(id) != "mlakv-3") continue;
    absl::StatusOr<v1::Sequence> seq = (*fresh)->GetSequence("p", id);
    ASSERT_EQ(seq.status().code(), absl::StatusCode::kUnavailable) << id << ": " << seq.status();
    named += seq.status().message().find(dead) != std::string::npos;
  }
  EXPECT_EQ(named, failed);

  // Back on its address (empty: a restart loses the cache): probed healthy
  // again, its old sequences are NOT_FOUND there.
  ServerProcess again("127.0.0.3", port_, "mlakv-3", dir_);
  ASSERT_TRUE(again.Start()) << again.log();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  (*fleet)->Refresh();
  for (const FleetClient::ServerState& s : (*fleet)->Servers()) EXPECT_TRUE(s.healthy) << s.address << s.last_error;
  for (int i = 0; i < kSequences; ++i) {
    const std::string id = absl::StrCat("s", i);
    std::optional<std::string> owner = (*fleet)->OwnerOf(id);
    if (!owner || *owner != "mlakv-3") continue;
    EXPECT_EQ((*fleet)->GetSequence("p", id).status().code(), absl::StatusCode::kNotFound) << id;
    EXPECT_FALSE((*fleet)->OwnerOf(id).has_value()) << "NOT_FOUND from the owner forgets it";
  }
}

TEST_F(FleetTest, AFourthServerFoundByDnsTakesAQuarterOfNewSequencesAndMovesNone) {
  dns_.Set(Ips());
  absl::StatusOr<std::unique_ptr<FleetClient>> fleet = FleetClient::Create(DnsOptions());
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  ASSERT_EQ((*fleet)->Servers().size(), 3u);
  constexpr int kOld = 1500, kNew = 3000;
  std::map<std::string, std::string> old_owner;
  for (int i = 0; i < kOld; ++i) {
    const std::string id = absl::StrCat("old-", i);
    ASSERT_TRUE(AppendOne(**fleet, id).ok()) << id;
    old_owner[id] = *(*fleet)->OwnerOf(id);
  }

  ServerProcess fourth("127.0.0.5", port_, "mlakv-5", dir_);
  ASSERT_TRUE(fourth.Start()) << fourth.log();
  std::vector<std::string> ips = Ips();
  ips.push_back("127.0.0.5");
  dns_.Set(ips);
  (*fleet)->Refresh();
  ASSERT_EQ((*fleet)->Servers().size(), 4u);
  for (const FleetClient::ServerState& s : (*fleet)->Servers()) EXPECT_TRUE(s.healthy) << s.address << s.last_error;

  int to_fourth = 0;
  for (int i = 0; i < kNew; ++i) {
    const std::string id = absl::StrCat("new-", i);
    ASSERT_TRUE(AppendOne(**fleet, id).ok()) << id;
    to_fourth += *(*fleet)->OwnerOf(id) == "mlakv-5";
  }
  EXPECT_NEAR(to_fourth, kNew / 4, kNew / 4 * 0.15);
  // None of the old moved: each is where it was created, and only there.
  const std::map<std::string, std::vector<std::string>> where = WhereListed(**fleet);
  for (const auto& [id, owner] : old_owner) {
    ASSERT_EQ(where.at(id), std::vector<std::string>{owner}) << id;
    absl::StatusOr<v1::Sequence> seq = (*fleet)->GetSequence("p", id);
    ASSERT_TRUE(seq.ok()) << id << ": " << seq.status();
    EXPECT_EQ(seq->server_id(), owner);
  }

  // A failed lookup keeps the servers known; a name that drops an address
  // drops that server and the owners recorded on it.
  dns_.Fail(true);
  (*fleet)->Refresh();
  EXPECT_EQ((*fleet)->Servers().size(), 4u);
  dns_.Fail(false);
  dns_.Set(Ips());
  (*fleet)->Refresh();
  EXPECT_EQ((*fleet)->Servers().size(), 3u);
  for (int i = 0; i < kNew; ++i) {
    std::optional<std::string> owner = (*fleet)->OwnerOf(absl::StrCat("new-", i));
    if (owner) {
      EXPECT_NE(*owner, "mlakv-5");
    }
  }
}

TEST_F(FleetTest, NoHealthyServerIsUnavailableNamingEach) {
  dns_.Set({"127.0.0.9"});  // nothing listens there
  absl::StatusOr<std::unique_ptr<FleetClient>> fleet = FleetClient::Create(DnsOptions());
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  absl::Status s = AppendOne(**fleet, "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("127.0.0.9"), std::string::npos) << s;
  // A name with no address at all.
  dns_.Set({});
  (*fleet)->Refresh();
  s = AppendOne(**fleet, "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  // A --server_id nobody has.
  fleet = FleetClient::Create(ListOptions());
  ASSERT_TRUE(fleet.ok());
  absl::StatusOr<v1::Sequence> seq = (*fleet)->GetSequence("p", "x", {}, "mlakv-99");
  EXPECT_EQ(seq.status().code(), absl::StatusCode::kNotFound) << seq.status();
  // The one it names is used, whatever placement would pick.
  for (const auto& server : servers_) {
    ASSERT_TRUE(AppendOne(**fleet, "pinned-" + server->id()).ok());
  }
  const std::string ckv(kCkvBytes, '\0'), kpe(kKpeBytes, '\0');
  AppendRows a{.pool = "p", .sequence = "chosen", .rows = 1};
  a.layers.push_back(LayerBytes{.layer = 0, .ckv = ckv, .kpe = kpe});
  ASSERT_TRUE((*fleet)->Append(a, "mlakv-4").ok());
  EXPECT_EQ(*(*fleet)->OwnerOf("chosen"), "mlakv-4");
  EXPECT_EQ(WhereListed(**fleet).at("chosen"), std::vector<std::string>{"mlakv-4"});
}

}  // namespace
}  // namespace mlakv
