// Rendezvous placement (client/rendezvous.h) and the fleet's server lists
// (client/server_set.h). The weights are pinned: client/python/mlakv/fleet.py
// asserts the same numbers (client/python/tests/test_fleet.py), so that a
// C++ and a Python client place a sequence on the same server.
#include "client/rendezvous.h"

#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/server_set.h"
#include "gtest/gtest.h"

namespace mlakv {
namespace {

TEST(Rendezvous, HashesArePinned) {
  EXPECT_EQ(Fnv1a64(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(Fnv1a64("a"), 0xaf63dc4c8601ec8cULL);  // FNV-1a's published value
  EXPECT_EQ(Mix64(0), 0u);
  EXPECT_EQ(Mix64(1), 0x5692161d100b05e5ULL);
  EXPECT_EQ(RendezvousWeight("req-1", "127.0.0.2:50051"), 0xfe218170f032db47ULL);
  EXPECT_EQ(RendezvousWeight("req-1", "127.0.0.3:50051"), 0x1b67bb7b819b033dULL);
  EXPECT_EQ(RendezvousWeight("", "10.0.0.1:50051"), 0xba77ebe0b97c8297ULL);
  EXPECT_EQ(RendezvousWeight("seq-\xc3\xa9", "[::1]:1"), 0x1d96a2e0803372c1ULL);
}

TEST(Rendezvous, PicksTheHighestWeightAndNoneFromNoKeys) {
  EXPECT_EQ(PickRendezvous("x", {}), -1);
  const std::vector<std::string_view> keys = {"127.0.0.2:50051", "127.0.0.3:50051"};
  // 0xfe21... > 0x1b67...
  EXPECT_EQ(PickRendezvous("req-1", keys), 0);
  // The order keys are given in does not matter.
  EXPECT_EQ(PickRendezvous("req-1", {keys[1], keys[0]}), 1);
}

std::vector<std::string> Keys(int n) {
  std::vector<std::string> keys;
  for (int i = 0; i < n; ++i) keys.push_back(absl::StrCat("10.1.0.", i + 1, ":50051"));
  return keys;
}

int Pick(const std::string& id, const std::vector<std::string>& keys) {
  return PickRendezvous(id, std::vector<std::string_view>(keys.begin(), keys.end()));
}

TEST(Rendezvous, SpreadsEvenlyAndAJoinMovesOnlyWhatTheNewServerWins) {
  constexpr int kIds = 30000;
  const std::vector<std::string> three = Keys(3), four = Keys(4);
  std::map<int, int> per_server;
  int moved = 0, to_new = 0;
  for (int i = 0; i < kIds; ++i) {
    const std::string id = absl::StrCat("req-", i);
    const int before = Pick(id, three), after = Pick(id, four);
    ++per_server[before];
    if (after != before) {
      ++moved;
      // A sequence that moves moves to the newcomer, never between old servers.
      EXPECT_EQ(after, 3) << id;
    }
    to_new += after == 3;
  }
  for (const auto& [server, count] : per_server) {
    EXPECT_NEAR(count, kIds / 3, kIds / 3 * 0.05) << "server " << server;
  }
  EXPECT_EQ(moved, to_new);
  EXPECT_NEAR(to_new, kIds / 4, kIds / 4 * 0.05);
}

TEST(Rendezvous, ALeavingServerHandsOnOnlyItsOwn) {
  const std::vector<std::string> four = Keys(4);
  std::vector<std::string> without_second = four;
  without_second.erase(without_second.begin() + 1);
  for (int i = 0; i < 10000; ++i) {
    const std::string id = absl::StrCat("s", i);
    const std::string& before = four[Pick(id, four)];
    const std::string& after = without_second[Pick(id, without_second)];
    if (before != four[1]) {
      EXPECT_EQ(after, before) << id;
    }
  }
}

TEST(ServerSet, ListsAreHostPortsWithoutDuplicates) {
  absl::StatusOr<ServerSetSpec> spec = ParseServerList("127.0.0.2:50051, 127.0.0.3:50051,[::1]:7");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->servers, (std::vector<std::string>{"127.0.0.2:50051", "127.0.0.3:50051", "[::1]:7"}));
  EXPECT_FALSE(spec->uses_dns());
  for (const char* bad : {"", "a:1,,b:2", "noport", "h:0", "h:65536", "h:x", ":80", "::1:80", "[::1:80"}) {
    absl::StatusOr<ServerSetSpec> r = ParseServerList(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  absl::StatusOr<ServerSetSpec> twice = ParseServerList("a:1,a:1");
  EXPECT_NE(twice.status().message().find("twice"), std::string::npos) << twice.status();
  // A hostile entry is quoted, bounded.
  absl::StatusOr<ServerSetSpec> hostile = ParseServerList(std::string(5000, 'x') + "\n:1x");
  EXPECT_LT(hostile.status().message().size(), 400u);
  EXPECT_EQ(hostile.status().message().find('\n'), std::string::npos);
}

TEST(ServerSet, ServiceIsDnsNameAndPort) {
  absl::StatusOr<ServerSetSpec> spec = ParseServiceTarget("dns:///mlakv.kv.svc.cluster.local:50051");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->dns_name, "mlakv.kv.svc.cluster.local");
  EXPECT_EQ(spec->port, 50051);
  EXPECT_TRUE(spec->uses_dns());
  for (const char* bad : {"mlakv:50051", "dns:///mlakv", "dns://authority/mlakv:1", "dns:///:1", "ipv4:1.2.3.4:5"}) {
    EXPECT_EQ(ParseServiceTarget(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(ServerSet, JoinHostPortBracketsIpv6) {
  EXPECT_EQ(JoinHostPort("10.0.0.1", 5), "10.0.0.1:5");
  EXPECT_EQ(JoinHostPort("fd00::1", 5), "[fd00::1]:5");
}

TEST(ServerSet, TheSystemResolverResolvesLoopbackAndNamesWhatFails) {
  absl::StatusOr<std::vector<std::string>> ips = SystemResolver()("127.0.0.3");
  ASSERT_TRUE(ips.ok()) << ips.status();
  EXPECT_EQ(*ips, std::vector<std::string>{"127.0.0.3"});
  absl::StatusOr<std::vector<std::string>> none = SystemResolver()("no-such-host.invalid");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(none.status().message().find("no-such-host.invalid"), std::string::npos);
}

}  // namespace
}  // namespace mlakv
