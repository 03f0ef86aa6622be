// MetricsRegistry: text exposition format 0.0.4 rendering, escaping, label
// handling, histogram buckets, collectors, name validation.
#include "server/metrics.h"

#include <cmath>
#include <limits>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mlakv::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(MetricsFormat, EscapesHelpText) {
  EXPECT_EQ(EscapeHelp("a\\b\nc\"d"), "a\\\\b\\nc\"d");  // quotes stay in HELP
}

TEST(MetricsFormat, EscapesLabelValues) {
  EXPECT_EQ(EscapeLabelValue("a\\b\nc\"d"), "a\\\\b\\nc\\\"d");
}

TEST(MetricsFormat, FormatsValues) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(42), "42");
  EXPECT_EQ(FormatValue(0.1), "0.1");
  EXPECT_EQ(FormatValue(1e21), "1e+21");
  EXPECT_EQ(FormatValue(-2.5), "-2.5");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatValue(std::nan("")), "NaN");
  EXPECT_EQ(FormatValue(12345678901234.0), "12345678901234");
}

TEST(MetricsFormat, ValidatesNames) {
  EXPECT_TRUE(IsValidMetricName("mlakv_rpcs_total"));
  EXPECT_TRUE(IsValidMetricName("ns:sub_total"));
  EXPECT_FALSE(IsValidMetricName("9lives"));
  EXPECT_FALSE(IsValidMetricName("has-dash"));
  EXPECT_FALSE(IsValidMetricName(""));
  EXPECT_TRUE(IsValidLabelName("method"));
  EXPECT_FALSE(IsValidLabelName("__reserved"));
  EXPECT_FALSE(IsValidLabelName("a:b"));
}

TEST(MetricsRegistry, RendersCounterWithHelpTypeAndLabels) {
  MetricsRegistry r;
  auto c = r.AddCounter("mlakv_rpcs_total", "RPCs finished.\nBy method.", {"method", "code"});
  ASSERT_TRUE(c.ok()) << c.status();
  (*c)->Add({"Append", "OK"});
  (*c)->Add({"Append", "OK"}, 2);
  (*c)->Add({"GetPool", "NOT_FOUND"});
  (*c)->Add({"Append", "OK"}, -5);  // ignored: counters only go up
  (*c)->Add({"only-one-value"});   // ignored: wrong arity
  EXPECT_EQ((*c)->Value({"Append", "OK"}), 3);
  EXPECT_EQ(r.Render(),
            "# HELP mlakv_rpcs_total RPCs finished.\\nBy method.\n"
            "# TYPE mlakv_rpcs_total counter\n"
            "mlakv_rpcs_total{method=\"Append\",code=\"OK\"} 3\n"
            "mlakv_rpcs_total{method=\"GetPool\",code=\"NOT_FOUND\"} 1\n");
}

TEST(MetricsRegistry, EscapesLabelValuesInSamples) {
  MetricsRegistry r;
  auto g = r.AddGauge("mlakv_pool_sequences", "Sequences.", {"pool"});
  ASSERT_TRUE(g.ok()) << g.status();
  (*g)->Set({"we\"ird\\name\n"}, 7);
  EXPECT_THAT(r.Render(), HasSubstr("mlakv_pool_sequences{pool=\"we\\\"ird\\\\name\\n\"} 7\n"));
}

TEST(MetricsRegistry, RendersUnlabelledGaugeAndEmptyFamily) {
  MetricsRegistry r;
  auto g = r.AddGauge("mlakv_ipc_regions", "Registered regions.", {});
  auto e = r.AddCounter("mlakv_empty_total", "Nothing yet.", {"x"});
  ASSERT_TRUE(g.ok() && e.ok());
  (*g)->Set({}, 0);
  (*g)->Add({}, 2);
  (*g)->Add({}, -1);
  EXPECT_EQ(r.Render(),
            "# HELP mlakv_ipc_regions Registered regions.\n"
            "# TYPE mlakv_ipc_regions gauge\n"
            "mlakv_ipc_regions 1\n"
            "# HELP mlakv_empty_total Nothing yet.\n"
            "# TYPE mlakv_empty_total counter\n");
}

TEST(MetricsRegistry, HistogramBucketsAreCumulativeWithInfSumCount) {
  MetricsRegistry r;
  auto h = r.AddHistogram("mlakv_append_latency_seconds", "Append latency.", {"method"}, {0.001, 0.01, 0.1});
  ASSERT_TRUE(h.ok()) << h.status();
  for (double v : {0.0005, 0.001, 0.005, 0.05, 2.0}) (*h)->Observe({"Append"}, v);
  EXPECT_EQ((*h)->Count({"Append"}), 5u);
  EXPECT_EQ(r.Render(),
            "# HELP mlakv_append_latency_seconds Append latency.\n"
            "# TYPE mlakv_append_latency_seconds histogram\n"
            "mlakv_append_latency_seconds_bucket{method=\"Append\",le=\"0.001\"} 2\n"  // le is inclusive
            "mlakv_append_latency_seconds_bucket{method=\"Append\",le=\"0.01\"} 3\n"
            "mlakv_append_latency_seconds_bucket{method=\"Append\",le=\"0.1\"} 4\n"
            "mlakv_append_latency_seconds_bucket{method=\"Append\",le=\"+Inf\"} 5\n"
            "mlakv_append_latency_seconds_sum{method=\"Append\"} 2.0565\n"
            "mlakv_append_latency_seconds_count{method=\"Append\"} 5\n");
}

TEST(MetricsRegistry, UnlabelledHistogramPutsLeAlone) {
  MetricsRegistry r;
  auto h = r.AddHistogram("h_seconds", "h", {}, {1});
  ASSERT_TRUE(h.ok());
  (*h)->Observe({}, 0.5);
  EXPECT_THAT(r.Render(), HasSubstr("h_seconds_bucket{le=\"1\"} 1\nh_seconds_bucket{le=\"+Inf\"} 1\n"
                                    "h_seconds_sum 0.5\nh_seconds_count 1\n"));
}

TEST(MetricsRegistry, RejectsBadRegistrations) {
  MetricsRegistry r;
  ASSERT_TRUE(r.AddCounter("a_total", "a", {}).ok());
  EXPECT_EQ(r.AddGauge("a_total", "again", {}).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(r.AddCounter("bad-name", "x", {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddCounter("b_total", "x", {"__x"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddCounter("c_total", "x", {"m", "m"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddHistogram("d", "x", {"le"}, {1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddHistogram("e", "x", {}, {2, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddHistogram("f", "x", {}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.AddHistogram("g", "x", {}, {1, std::numeric_limits<double>::infinity()}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MetricsRegistry, CollectorsRunAtEveryRender) {
  MetricsRegistry r;
  auto g = r.AddGauge("mlakv_pool_pages_used", "Used pages.", {"pool"});
  ASSERT_TRUE(g.ok());
  int live = 3;
  r.AddCollector([&] {
    (*g)->Clear();
    (*g)->Set({"default"}, live);
  });
  EXPECT_THAT(r.Render(), HasSubstr("mlakv_pool_pages_used{pool=\"default\"} 3\n"));
  live = 9;
  EXPECT_THAT(r.Render(), HasSubstr("mlakv_pool_pages_used{pool=\"default\"} 9\n"));
  EXPECT_THAT(r.Render(), Not(HasSubstr("} 3\n")));
}

TEST(MetricsRegistry, ConcurrentUpdatesAreAllCounted) {
  MetricsRegistry r;
  auto c = r.AddCounter("n_total", "n", {"t"});
  auto h = r.AddHistogram("l_seconds", "l", {}, {0.5});
  ASSERT_TRUE(c.ok() && h.ok());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 10000; ++i) {
        (*c)->Add({t % 2 ? "odd" : "even"});
        (*h)->Observe({}, 1);
        if (i % 1000 == 0) r.Render();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ((*c)->Value({"odd"}) + (*c)->Value({"even"}), 40000);
  EXPECT_EQ((*h)->Count({}), 40000u);
  EXPECT_THAT(r.Render(), HasSubstr("l_seconds_bucket{le=\"+Inf\"} 40000\n"));
}

}  // namespace
}  // namespace mlakv::server
