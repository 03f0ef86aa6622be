#include "tests/soak/soak_report.h"

#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/util/json_util.h"

namespace mlakv::soak {
namespace {

constexpr size_t kKeptViolations = 200;

template <typename Map>
nlohmann::json MapJson(const Map& m) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : m) j[k] = v;
  return j;
}

template <typename Map>
int64_t Sum(const Map& m) {
  int64_t n = 0;
  for (const auto& [k, v] : m) n += v;
  return n;
}

nlohmann::json OptionalJson(const std::optional<int64_t>& v) { return v ? nlohmann::json(*v) : nlohmann::json(); }

std::string Mib(const std::optional<int64_t>& kb) {
  return kb ? absl::StrFormat("%.1f MiB", *kb / 1024.0) : std::string("n/a");
}

}  // namespace

void SoakReport::CountOp(absl::string_view op) {
  absl::MutexLock lock(&mu_);
  ++ops_[std::string(op)];
}

void SoakReport::CountFault(absl::string_view kind) {
  absl::MutexLock lock(&mu_);
  ++faults_[std::string(kind)];
}

void SoakReport::CountOutcome(absl::string_view kind, absl::string_view outcome) {
  absl::MutexLock lock(&mu_);
  ++outcomes_[absl::StrCat(kind, "/", outcome)];
}

void SoakReport::AddAppended(uint64_t rows, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  rows_appended_ += rows;
  bytes_appended_ += bytes;
}

void SoakReport::Violation(absl::string_view where, absl::string_view what) {
  const std::string line = absl::StrCat(absl::FormatTime("%H:%M:%E3S", absl::Now(), absl::LocalTimeZone()), " ",
                                        where, ": ", what);
  std::cerr << "VIOLATION " << line << std::endl;
  absl::MutexLock lock(&mu_);
  ++violations_;
  if (violation_details_.size() < kKeptViolations) violation_details_.push_back(line);
}

int64_t SoakReport::violations() const {
  absl::MutexLock lock(&mu_);
  return violations_;
}

void SoakReport::Failure(absl::string_view what) {
  std::cerr << "FAILURE " << what << std::endl;
  absl::MutexLock lock(&mu_);
  failures_.emplace_back(what);
}

bool SoakReport::failed() const {
  absl::MutexLock lock(&mu_);
  return violations_ > 0 || !failures_.empty();
}

void SoakReport::SampleRss(std::optional<int64_t> kb) {
  if (!kb) return;
  absl::MutexLock lock(&mu_);
  if (!rss_start_kb_) rss_start_kb_ = kb;
  rss_end_kb_ = kb;
  rss_peak_kb_ = std::max(rss_peak_kb_.value_or(0), *kb);
}

void SoakReport::CountCheck(absl::Duration convergence, std::optional<int64_t> rss_kb) {
  absl::MutexLock lock(&mu_);
  ++checks_;
  max_convergence_ = std::max(max_convergence_, convergence);
  if (rss_kb) rss_at_checks_kb_.push_back(*rss_kb);
}

void SoakReport::SetPagesSeen(uint32_t seen, uint32_t total) {
  absl::MutexLock lock(&mu_);
  pages_seen_ = seen;
  pages_total_ = total;
}

void SoakReport::SetFinalPool(const v1::Pool& pool) {
  absl::MutexLock lock(&mu_);
  final_pool_ = pool;
}

void SoakReport::SetServer(std::string mode, std::string target, std::string device) {
  absl::MutexLock lock(&mu_);
  mode_ = std::move(mode);
  target_ = std::move(target);
  device_ = std::move(device);
}

void SoakReport::SetServerExit(int code) {
  absl::MutexLock lock(&mu_);
  server_exit_ = code;
}

void SoakReport::SetDuration(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  duration_ = d;
}

void SoakReport::SetSeed(uint64_t seed, int clients) {
  absl::MutexLock lock(&mu_);
  seed_ = seed;
  clients_ = clients;
}

nlohmann::json SoakReport::ToJson() const {
  absl::MutexLock lock(&mu_);
  nlohmann::json j;
  j["duration_s"] = absl::ToDoubleSeconds(duration_);
  j["seed"] = seed_;
  j["clients"] = clients_;
  j["server"] = {{"mode", mode_}, {"target", target_}, {"device", device_},
                 {"exit_code", server_exit_ ? nlohmann::json(*server_exit_) : nlohmann::json()}};
  j["operations"] = MapJson(ops_);
  j["operations_total"] = Sum(ops_);
  j["faults"] = MapJson(faults_);
  j["faults_total"] = Sum(faults_);
  j["fault_outcomes"] = MapJson(outcomes_);
  j["violations"] = violations_;
  j["violation_details"] = violation_details_;
  j["failures"] = failures_;
  j["rows_appended"] = rows_appended_;
  j["bytes_appended"] = bytes_appended_;
  j["quiescent_checks"] = checks_;
  j["max_convergence_ms"] = absl::ToDoubleMilliseconds(max_convergence_);
  j["pages_seen"] = {{"seen", pages_seen_}, {"total", pages_total_}};
  j["server_rss_kb"] = {{"start", OptionalJson(rss_start_kb_)},
                        {"end", OptionalJson(rss_end_kb_)},
                        {"peak", OptionalJson(rss_peak_kb_)},
                        {"at_checks", rss_at_checks_kb_}};
  if (final_pool_) {
    std::string pool_json;
    google::protobuf::util::JsonPrintOptions print;
    print.always_print_primitive_fields = true;
    print.preserve_proto_field_names = true;
    if (google::protobuf::util::MessageToJsonString(*final_pool_, &pool_json, print).ok()) {
      j["final_pool"] = nlohmann::json::parse(pool_json);
    }
  }
  j["passed"] = violations_ == 0 && failures_.empty();
  return j;
}

std::string SoakReport::ToText() const {
  absl::MutexLock lock(&mu_);
  std::string out = absl::StrFormat(
      "mlakv soak: %s server %s (%s), %d clients, seed %d, %.1f s\n", mode_, target_, device_, clients_, seed_,
      absl::ToDoubleSeconds(duration_));
  absl::StrAppend(&out, "  operations  ", Sum(ops_), ":");
  for (const auto& [k, v] : ops_) absl::StrAppend(&out, " ", k, "=", v);
  absl::StrAppend(&out, "\n  faults      ", Sum(faults_), ":");
  for (const auto& [k, v] : faults_) absl::StrAppend(&out, " ", k, "=", v);
  absl::StrAppend(&out, "\n  outcomes   ");
  for (const auto& [k, v] : outcomes_) absl::StrAppend(&out, " ", k, "=", v);
  absl::StrAppend(&out, absl::StrFormat("\n  appended    %d rows, %.1f MiB\n", rows_appended_,
                                        bytes_appended_ / 1048576.0));
  absl::StrAppend(&out, absl::StrFormat("  checks      %d quiescent checks, slowest convergence %.0f ms\n", checks_,
                                        absl::ToDoubleMilliseconds(max_convergence_)));
  absl::StrAppend(&out, "  server RSS  start ", Mib(rss_start_kb_), ", end ", Mib(rss_end_kb_), ", peak ",
                  Mib(rss_peak_kb_), absl::StrFormat(" (the run has used %d of the pool's %d pages)\n", pages_seen_,
                                                     pages_total_));
  if (final_pool_) {
    absl::StrAppend(&out, absl::StrFormat("  final pool  %s: %d pages total, %d used, %d free, %d sequences\n",
                                          final_pool_->name(), final_pool_->pages_total(), final_pool_->pages_used(),
                                          final_pool_->pages_free(), final_pool_->sequences()));
  }
  if (server_exit_) absl::StrAppend(&out, "  server exit ", *server_exit_, "\n");
  for (const std::string& f : failures_) absl::StrAppend(&out, "  FAILURE ", f, "\n");
  absl::StrAppend(&out, "  violations  ", violations_, "\n");
  for (const std::string& v : violation_details_) absl::StrAppend(&out, "    ", v, "\n");
  absl::StrAppend(&out, violations_ == 0 && failures_.empty() ? "PASSED\n" : "FAILED\n");
  return out;
}

}  // namespace mlakv::soak
