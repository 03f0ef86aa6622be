// SoakReport: what a run did and found, filled by every client thread and
// the coordinator; printed at the end and written as JSON (--report).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mlakv/v1/kv_cache.pb.h"
#include "nlohmann/json.hpp"

namespace mlakv::soak {

class SoakReport {
 public:
  void CountOp(absl::string_view op);
  void CountFault(absl::string_view kind);
  // How a fault ended where the protocol allows more than one end
  // ("cancel_race" / "committed").
  void CountOutcome(absl::string_view kind, absl::string_view outcome);
  void AddAppended(uint64_t rows, uint64_t bytes);
  // A broken promise: printed to stderr at once, counted, the first 200 kept.
  void Violation(absl::string_view where, absl::string_view what);
  int64_t violations() const;
  // Where the run could not even start or finish (setup, server exit):
  // also fails the run, reported apart from the violations.
  void Failure(absl::string_view what);
  bool failed() const;

  void SampleRss(std::optional<int64_t> kb);
  // One quiescent check: how long the pool took to agree with the models, and
  // the server's RSS then (kept per check, to see growth over a long run).
  void CountCheck(absl::Duration convergence, std::optional<int64_t> rss_kb);
  // Distinct pages the audits have seen in the soak's page tables: the
  // share of the pool's (lazily allocated) host caches the run has touched,
  // to read the server's RSS against.
  void SetPagesSeen(uint32_t seen, uint32_t total);
  void SetFinalPool(const v1::Pool& pool);
  void SetServer(std::string mode, std::string target, std::string device);
  void SetServerExit(int code);
  void SetDuration(absl::Duration d);
  void SetSeed(uint64_t seed, int clients);

  nlohmann::json ToJson() const;
  std::string ToText() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, int64_t, std::less<>> ops_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t, std::less<>> faults_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t, std::less<>> outcomes_ ABSL_GUARDED_BY(mu_);
  int64_t violations_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> violation_details_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> failures_ ABSL_GUARDED_BY(mu_);
  uint64_t rows_appended_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_appended_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<int64_t> rss_start_kb_ ABSL_GUARDED_BY(mu_);
  std::optional<int64_t> rss_end_kb_ ABSL_GUARDED_BY(mu_);
  std::optional<int64_t> rss_peak_kb_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> rss_at_checks_kb_ ABSL_GUARDED_BY(mu_);
  int64_t checks_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration max_convergence_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::Pool> final_pool_ ABSL_GUARDED_BY(mu_);
  uint32_t pages_seen_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t pages_total_ ABSL_GUARDED_BY(mu_) = 0;
  std::string mode_ ABSL_GUARDED_BY(mu_);
  std::string target_ ABSL_GUARDED_BY(mu_);
  std::string device_ ABSL_GUARDED_BY(mu_);
  std::optional<int> server_exit_ ABSL_GUARDED_BY(mu_);
  absl::Duration duration_ ABSL_GUARDED_BY(mu_);
  uint64_t seed_ ABSL_GUARDED_BY(mu_) = 0;
  int clients_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace mlakv::soak
