// MetricsRegistry: counters, gauges and histograms with labels, rendered in
// the Prometheus text exposition format 0.0.4
// (https://prometheus.io/docs/instrumenting/exposition_formats/).
//
// A family has a name, a help text and fixed label names; its children are
// keyed by label values and created on first use. Every method is thread-safe.
// Collectors registered with AddCollector run at the start of each Render, so
// gauges that mirror live state (pool occupancy) are read at scrape time.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace mlakv::server {

using LabelValues = std::vector<std::string>;

// Monotonic counter family (`# TYPE name counter`). Name should end in _total.
class CounterFamily {
 public:
  // Adds `v` (>= 0; negative values are ignored) to the child `labels`, which
  // must have as many values as the family has label names (else ignored).
  void Add(const LabelValues& labels, double v = 1.0);
  // The child's value, 0 if it does not exist.
  double Value(const LabelValues& labels) const;

 private:
  friend class MetricsRegistry;
  explicit CounterFamily(size_t arity) : arity_(arity) {}
  const size_t arity_;
  mutable absl::Mutex mu_;
  std::map<LabelValues, double> values_ ABSL_GUARDED_BY(mu_);
};

// Gauge family (`# TYPE name gauge`).
class GaugeFamily {
 public:
  void Set(const LabelValues& labels, double v);
  void Add(const LabelValues& labels, double v);
  double Value(const LabelValues& labels) const;
  // Drops every child (a collector rebuilding the family from live state).
  void Clear();

 private:
  friend class MetricsRegistry;
  explicit GaugeFamily(size_t arity) : arity_(arity) {}
  const size_t arity_;
  mutable absl::Mutex mu_;
  std::map<LabelValues, double> values_ ABSL_GUARDED_BY(mu_);
};

// Histogram family (`# TYPE name histogram`): cumulative buckets with upper
// bounds `le`, plus _sum and _count.
class HistogramFamily {
 public:
  void Observe(const LabelValues& labels, double v);
  // Observations of the child, 0 if it does not exist.
  uint64_t Count(const LabelValues& labels) const;

 private:
  friend class MetricsRegistry;
  struct Child {
    std::vector<uint64_t> buckets;  // non-cumulative, [bounds.size() + 1], last = +Inf
    double sum = 0;
    uint64_t count = 0;
  };
  HistogramFamily(size_t arity, std::vector<double> bounds) : arity_(arity), bounds_(std::move(bounds)) {}
  const size_t arity_;
  const std::vector<double> bounds_;  // strictly increasing, finite
  mutable absl::Mutex mu_;
  std::map<LabelValues, Child> values_ ABSL_GUARDED_BY(mu_);
};

class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Families live as long as the registry. Errors: a name or label name that
  // is not a valid Prometheus identifier, a name registered twice, histogram
  // bounds not strictly increasing and finite, the reserved label "le" on a
  // histogram.
  absl::StatusOr<CounterFamily*> AddCounter(const std::string& name, const std::string& help,
                                            std::vector<std::string> label_names);
  absl::StatusOr<GaugeFamily*> AddGauge(const std::string& name, const std::string& help,
                                        std::vector<std::string> label_names);
  absl::StatusOr<HistogramFamily*> AddHistogram(const std::string& name, const std::string& help,
                                                std::vector<std::string> label_names, std::vector<double> bounds);
  // Runs before every Render (in registration order, one Render at a time).
  void AddCollector(std::function<void()> collector);

  // The text exposition format 0.0.4: for each family in registration order,
  // `# HELP`, `# TYPE` and one line per child (children ordered by label
  // values). Families without children render only HELP and TYPE.
  std::string Render() const;

  // Content-Type of Render's output.
  static constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";

 private:
  enum class Kind { kCounter, kGauge, kHistogram };
  struct Family {
    std::string name, help;
    std::vector<std::string> label_names;
    Kind kind;
    std::unique_ptr<CounterFamily> counter;
    std::unique_ptr<GaugeFamily> gauge;
    std::unique_ptr<HistogramFamily> histogram;
  };
  absl::Status CheckNew(const std::string& name, const std::vector<std::string>& label_names)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends a family of `kind` (its counter/gauge/histogram still to be set).
  Family* NewFamilyLocked(const std::string& name, const std::string& help, Kind kind,
                          std::vector<std::string> label_names) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Family>> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> collectors_ ABSL_GUARDED_BY(mu_);
  mutable absl::Mutex render_mu_;  // one Render (and its collectors) at a time
};

// Text-format helpers (exposed for tests).
// HELP text: backslash -> \\, newline -> \n.
std::string EscapeHelp(const std::string& s);
// Label value: backslash -> \\, double quote -> \", newline -> \n.
std::string EscapeLabelValue(const std::string& s);
// A sample value: shortest round-trip decimal, +Inf, -Inf, NaN.
std::string FormatValue(double v);
// [a-zA-Z_:][a-zA-Z0-9_:]*
bool IsValidMetricName(const std::string& s);
// [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__".
bool IsValidLabelName(const std::string& s);

}  // namespace mlakv::server
