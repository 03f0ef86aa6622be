// mlakv lease acquire | renew | release | list: leases on sequences (and the
// page leases MatchPrefix takes): while one lives, the tokens it covers do not
// change and their pages stay, even through a free (docs/server.md "Leases").
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"

namespace mlakv::cli {
namespace {

constexpr char kUsage[] =
    "lease acquire SEQ --holder H [--duration_ms N] [--tokens N] [--expect_generation G] [--pool P] [--json]\n"
    "       mlakv lease renew ID [--duration_ms N] [--pool P] [--json]\n"
    "       mlakv lease release ID [--pool P] [--json]\n"
    "       mlakv lease list [--pool P] [--json]";

int PrintLease(const char* verb, const v1::Lease& lease) {
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", ToJson(lease).c_str());
  } else {
    std::printf("%s %s\n", verb, DescribeLease(lease).c_str());
  }
  return kExitOk;
}

int Acquire(KvCacheClient& client, const std::string& sequence) {
  absl::StatusOr<v1::Lease> lease =
      client.AcquireLease(absl::GetFlag(FLAGS_pool), sequence, absl::GetFlag(FLAGS_holder),
                          absl::Milliseconds(absl::GetFlag(FLAGS_duration_ms)), absl::GetFlag(FLAGS_tokens),
                          absl::GetFlag(FLAGS_expect_generation));
  if (!lease.ok()) return Fail("lease acquire", lease.status());
  return PrintLease("acquired", *lease);
}

int Renew(KvCacheClient& client, uint64_t id) {
  absl::StatusOr<v1::Lease> lease =
      client.RenewLease(absl::GetFlag(FLAGS_pool), id, absl::Milliseconds(absl::GetFlag(FLAGS_duration_ms)));
  if (!lease.ok()) return Fail("lease renew", lease.status());
  return PrintLease("renewed", *lease);
}

int Release(KvCacheClient& client, uint64_t id) {
  absl::StatusOr<uint32_t> freed = client.ReleaseLease(absl::GetFlag(FLAGS_pool), id);
  if (!freed.ok()) return Fail("lease release", freed.status());
  if (absl::GetFlag(FLAGS_json)) {
    v1::ReleaseLeaseResponse response;
    response.set_pages_freed(*freed);
    std::printf("%s\n", ToJson(response).c_str());
  } else {
    std::printf("released lease %llu: %u page(s) returned to the pool\n", static_cast<unsigned long long>(id),
                *freed);
  }
  return kExitOk;
}

int List(KvCacheClient& client) {
  absl::StatusOr<std::vector<v1::Lease>> leases = client.ListLeases(absl::GetFlag(FLAGS_pool));
  if (!leases.ok()) return Fail("lease list", leases.status());
  if (absl::GetFlag(FLAGS_json)) {
    v1::ListLeasesResponse response;
    for (const v1::Lease& lease : *leases) *response.add_leases() = lease;
    response.set_total(static_cast<uint32_t>(leases->size()));
    std::printf("%s\n", ToJson(response).c_str());
    return kExitOk;
  }
  std::printf("%-8s %-24s %-20s %-16s %8s %8s %12s %s\n", "LEASE", "SEQUENCE", "GENERATION", "HOLDER", "TOKENS",
              "PAGES", "EXPIRES_MS", "STATE");
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  for (const v1::Lease& lease : *leases) {
    const bool page_lease = lease.sequence().empty();
    std::printf("%-8llu %-24s %-20s %-16s %8u %8s %12lld %s\n", static_cast<unsigned long long>(lease.lease_id()),
                page_lease ? "(pages)" : lease.sequence().c_str(),
                page_lease ? "-" : absl::StrCat(lease.generation()).c_str(), lease.holder().c_str(), lease.tokens(),
                page_lease ? absl::StrCat(lease.pages_size()).c_str() : "-",
                static_cast<long long>(lease.expire_time_unix_ms() - now_ms),
                lease.sequence_freed() ? "sequence-freed" : "live");
  }
  std::printf("%zu lease(s)\n", leases->size());
  return kExitOk;
}

}  // namespace

int RunLease(const std::vector<std::string>& args) {
  if (args.empty()) return UsageError(kUsage, "mlakv lease: give acquire, renew, release or list");
  const std::string& verb = args[0];
  uint64_t id = 0;
  if (verb == "acquire") {
    if (args.size() != 2) return UsageError(kUsage, "mlakv lease acquire: give one sequence id");
    if (absl::GetFlag(FLAGS_holder).empty()) return UsageError(kUsage, "mlakv lease acquire: --holder H is required");
  } else if (verb == "renew" || verb == "release") {
    if (args.size() != 2 || !ParseUint64(args[1], &id)) {
      return UsageError(kUsage, absl::StrCat("mlakv lease ", verb, ": give one lease id (a number)"));
    }
  } else if (verb == "list") {
    if (args.size() != 1) return UsageError(kUsage, "mlakv lease list takes no arguments");
  } else {
    return UsageError(kUsage, absl::StrCat("mlakv lease: unknown subcommand \"", verb, "\""));
  }
  absl::StatusOr<Connection> client = verb == "acquire" ? ConnectForSequence(args[1]) : ConnectFromFlags();
  if (!client.ok()) return Fail(absl::StrCat("lease ", verb), client.status());
  if (verb == "acquire") return Acquire(**client, args[1]);
  if (verb == "renew") return Renew(**client, id);
  if (verb == "release") return Release(**client, id);
  return List(**client);
}

}  // namespace mlakv::cli
