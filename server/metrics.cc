#include "server/metrics.h"

#include <charconv>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace mlakv::server {
namespace {

bool IsIdent(const std::string& s, bool allow_colon) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (allow_colon && c == ':');
    bool digit = c >= '0' && c <= '9';
    if (!(alpha || (i > 0 && digit))) return false;
  }
  return true;
}

// `{a="x",b="y"}` (with an optional extra label appended), or "" for none.
std::string LabelSet(const std::vector<std::string>& names, const LabelValues& values,
                     const char* extra_name = nullptr, const std::string& extra_value = "") {
  if (names.empty() && extra_name == nullptr) return "";
  std::string out = "{";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) out += ',';
    absl::StrAppend(&out, names[i], "=\"", EscapeLabelValue(values[i]), "\"");
  }
  if (extra_name != nullptr) {
    if (!names.empty()) out += ',';
    absl::StrAppend(&out, extra_name, "=\"", EscapeLabelValue(extra_value), "\"");
  }
  out += '}';
  return out;
}

}  // namespace

std::string EscapeHelp(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string EscapeLabelValue(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  if (ec != std::errc()) return absl::StrCat(v);
  return std::string(buf, end);
}

bool IsValidMetricName(const std::string& s) { return IsIdent(s, /*allow_colon=*/true); }

bool IsValidLabelName(const std::string& s) {
  return IsIdent(s, /*allow_colon=*/false) && s.rfind("__", 0) != 0;
}

// ---------------------------------------------------------------- families

void CounterFamily::Add(const LabelValues& labels, double v) {
  if (labels.size() != arity_ || !(v >= 0)) return;
  absl::MutexLock lock(&mu_);
  values_[labels] += v;
}

double CounterFamily::Value(const LabelValues& labels) const {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(labels);
  return it == values_.end() ? 0 : it->second;
}

void GaugeFamily::Set(const LabelValues& labels, double v) {
  if (labels.size() != arity_) return;
  absl::MutexLock lock(&mu_);
  values_[labels] = v;
}

void GaugeFamily::Add(const LabelValues& labels, double v) {
  if (labels.size() != arity_) return;
  absl::MutexLock lock(&mu_);
  values_[labels] += v;
}

double GaugeFamily::Value(const LabelValues& labels) const {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(labels);
  return it == values_.end() ? 0 : it->second;
}

void GaugeFamily::Clear() {
  absl::MutexLock lock(&mu_);
  values_.clear();
}

void HistogramFamily::Observe(const LabelValues& labels, double v) {
  if (labels.size() != arity_ || std::isnan(v)) return;
  // First bucket whose upper bound is >= v (le is inclusive).
  size_t b = 0;
  while (b < bounds_.size() && v > bounds_[b]) ++b;
  absl::MutexLock lock(&mu_);
  Child& c = values_[labels];
  if (c.buckets.empty()) c.buckets.assign(bounds_.size() + 1, 0);
  ++c.buckets[b];
  c.sum += v;
  ++c.count;
}

uint64_t HistogramFamily::Count(const LabelValues& labels) const {
  absl::MutexLock lock(&mu_);
  auto it = values_.find(labels);
  return it == values_.end() ? 0 : it->second.count;
}

// ---------------------------------------------------------------- registry

absl::Status MetricsRegistry::CheckNew(const std::string& name, const std::vector<std::string>& label_names) {
  if (!IsValidMetricName(name)) {
    return absl::InvalidArgumentError(absl::StrCat("metric name \"", name, "\" is not [a-zA-Z_:][a-zA-Z0-9_:]*"));
  }
  for (const auto& f : families_) {
    if (f->name == name) return absl::AlreadyExistsError(absl::StrCat("metric ", name, " registered twice"));
  }
  for (size_t i = 0; i < label_names.size(); ++i) {
    if (!IsValidLabelName(label_names[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("label name \"", label_names[i], "\" of ", name, " is not a valid label name"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (label_names[j] == label_names[i]) {
        return absl::InvalidArgumentError(absl::StrCat("label ", label_names[i], " of ", name, " named twice"));
      }
    }
  }
  return absl::OkStatus();
}

MetricsRegistry::Family* MetricsRegistry::NewFamilyLocked(const std::string& name, const std::string& help,
                                                          Kind kind, std::vector<std::string> label_names) {
  auto f = std::make_unique<Family>();
  f->name = name;
  f->help = help;
  f->kind = kind;
  f->label_names = std::move(label_names);
  families_.push_back(std::move(f));
  return families_.back().get();
}

absl::StatusOr<CounterFamily*> MetricsRegistry::AddCounter(const std::string& name, const std::string& help,
                                                           std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  if (auto s = CheckNew(name, label_names); !s.ok()) return s;
  const size_t arity = label_names.size();
  Family* f = NewFamilyLocked(name, help, Kind::kCounter, std::move(label_names));
  f->counter.reset(new CounterFamily(arity));
  return f->counter.get();
}

absl::StatusOr<GaugeFamily*> MetricsRegistry::AddGauge(const std::string& name, const std::string& help,
                                                       std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  if (auto s = CheckNew(name, label_names); !s.ok()) return s;
  const size_t arity = label_names.size();
  Family* f = NewFamilyLocked(name, help, Kind::kGauge, std::move(label_names));
  f->gauge.reset(new GaugeFamily(arity));
  return f->gauge.get();
}

absl::StatusOr<HistogramFamily*> MetricsRegistry::AddHistogram(const std::string& name, const std::string& help,
                                                               std::vector<std::string> label_names,
                                                               std::vector<double> bounds) {
  absl::MutexLock lock(&mu_);
  if (auto s = CheckNew(name, label_names); !s.ok()) return s;
  for (const auto& l : label_names) {
    if (l == "le") return absl::InvalidArgumentError(absl::StrCat("histogram ", name, " may not use label le"));
  }
  if (bounds.empty()) return absl::InvalidArgumentError(absl::StrCat("histogram ", name, " has no buckets"));
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1]))) {
      return absl::InvalidArgumentError(
          absl::StrCat("histogram ", name, " bounds must be finite and strictly increasing"));
    }
  }
  const size_t arity = label_names.size();
  Family* f = NewFamilyLocked(name, help, Kind::kHistogram, std::move(label_names));
  f->histogram.reset(new HistogramFamily(arity, std::move(bounds)));
  return f->histogram.get();
}

void MetricsRegistry::AddCollector(std::function<void()> collector) {
  absl::MutexLock lock(&mu_);
  collectors_.push_back(std::move(collector));
}

std::string MetricsRegistry::Render() const {
  absl::MutexLock render_lock(&render_mu_);
  std::vector<std::function<void()>> collectors;
  std::vector<const Family*> families;
  {
    absl::MutexLock lock(&mu_);
    collectors = collectors_;
    for (const auto& f : families_) families.push_back(f.get());
  }
  for (const auto& c : collectors) c();

  std::string out;
  for (const Family* f : families) {
    const char* type = f->kind == Kind::kCounter ? "counter" : f->kind == Kind::kGauge ? "gauge" : "histogram";
    absl::StrAppend(&out, "# HELP ", f->name, " ", EscapeHelp(f->help), "\n");
    absl::StrAppend(&out, "# TYPE ", f->name, " ", type, "\n");
    if (f->kind == Kind::kCounter || f->kind == Kind::kGauge) {
      std::map<LabelValues, double> values;
      if (f->counter) {
        absl::MutexLock lock(&f->counter->mu_);
        values = f->counter->values_;
      } else {
        absl::MutexLock lock(&f->gauge->mu_);
        values = f->gauge->values_;
      }
      for (const auto& [labels, v] : values) {
        absl::StrAppend(&out, f->name, LabelSet(f->label_names, labels), " ", FormatValue(v), "\n");
      }
      continue;
    }
    const HistogramFamily& h = *f->histogram;
    std::map<LabelValues, HistogramFamily::Child> values;
    {
      absl::MutexLock lock(&h.mu_);
      values = h.values_;
    }
    for (const auto& [labels, c] : values) {
      uint64_t cumulative = 0;
      for (size_t b = 0; b <= h.bounds_.size(); ++b) {
        cumulative += c.buckets[b];
        std::string le = b < h.bounds_.size() ? FormatValue(h.bounds_[b]) : "+Inf";
        absl::StrAppend(&out, f->name, "_bucket", LabelSet(f->label_names, labels, "le", le), " ", cumulative, "\n");
      }
      absl::StrAppend(&out, f->name, "_sum", LabelSet(f->label_names, labels), " ", FormatValue(c.sum), "\n");
      absl::StrAppend(&out, f->name, "_count", LabelSet(f->label_names, labels), " ", c.count, "\n");
    }
  }
  return out;
}

}  // namespace mlakv::server
