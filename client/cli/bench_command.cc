// mlakv bench: a load generator against a running server (LoadGenerator),
// with a live progress line on stderr and a summary (requests/s, GB/s of
// input rows, latency percentiles, errors by status code) at the end.
// Ctrl-C ends the run early; the sequences it created are freed either way.
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/cli/cli_flags.h"
#include "client/cli/command_support.h"
#include "client/cli/commands.h"
#include "client/load_generator.h"
#include "common/quote.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, mode, "append",
          "bench: append (rows_per_message rows x layers per request to one sequence per worker) or decode "
          "(AppendBatch of --sequences sequences x 1 token x --layers layers per request)");
ABSL_FLAG(int32_t, concurrency, 1, "bench: concurrent workers, one request in flight each");
ABSL_FLAG(int32_t, connections, 0,
          "bench: TCP connections shared by the workers (0: one per worker; 1 with --concurrency 4: four streams "
          "multiplexed on one HTTP/2 connection)");
ABSL_FLAG(int32_t, rows_per_message, 3584,
          "bench append: rows per request per layer (3584 bf16 rows x 1 layer = 3.94 MiB, one Append message)");
ABSL_FLAG(double, batch_fraction, 0, "bench append: share of requests sent as AppendBatch instead of Append, [0, 1]");
ABSL_FLAG(double, duration_s, 10, "bench: stop after this many seconds (0: only --requests bounds the run)");
ABSL_FLAG(int64_t, requests, 0, "bench: stop after this many requests in all (0: only --duration_s bounds the run)");
ABSL_FLAG(int32_t, layers, 1, "bench: layers 0..N-1 written by every request");
ABSL_FLAG(int32_t, sequences, 256, "bench decode: sequences per AppendBatch (per worker)");
ABSL_FLAG(bool, compact, false,
          "bench decode: send each step in AppendBatch's compact form (one batch_layers entry per layer holding "
          "every sequence's row)");
ABSL_FLAG(std::string, view, "full",
          "bench: what each response's sequences carry: full (the whole page table and per-layer lengths), basic "
          "(only the pages the request allocated, no per-layer lengths), compact (basic without the names), lengths "
          "(compact without the page table) or packed (--mode decode: every sequence in parallel arrays of one "
          "message)");

namespace mlakv::cli {
namespace {

constexpr char kUsage[] =
    "bench [--mode append|decode] [--concurrency N] [--connections C] [--rows_per_message R] [--batch_fraction F] "
    "[--sequences S] [--compact] [--view full|basic|compact|lengths] [--layers L] [--dtype bf16|f16] [--duration_s S | --requests N] [--pool P] [--server ADDR] "
    "[--json]";

std::atomic<bool> g_stop{false};
void OnInterrupt(int) { g_stop.store(true); }

absl::StatusOr<LoadOptions> OptionsFromFlags() {
  LoadOptions options;
  const std::string mode = absl::GetFlag(FLAGS_mode), dtype = absl::GetFlag(FLAGS_dtype);
  if (mode == "append") {
    options.mode = LoadOptions::Mode::kAppend;
  } else if (mode == "decode") {
    options.mode = LoadOptions::Mode::kDecode;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--mode \"", mode, "\" is not append or decode"));
  }
  if (dtype == "bf16") {
    options.dtype = v1::ROW_DTYPE_BFLOAT16;
  } else if (dtype == "f16") {
    options.dtype = v1::ROW_DTYPE_FLOAT16;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--dtype \"", dtype, "\" is not bf16 or f16"));
  }
  const std::string view = absl::GetFlag(FLAGS_view);
  if (view == "full") {
    options.view = v1::SEQUENCE_VIEW_FULL;
  } else if (view == "basic") {
    options.view = v1::SEQUENCE_VIEW_BASIC;
  } else if (view == "compact") {
    options.view = v1::SEQUENCE_VIEW_COMPACT;
  } else if (view == "lengths") {
    options.view = v1::SEQUENCE_VIEW_LENGTHS;
  } else if (view == "packed") {
    if (options.mode != LoadOptions::Mode::kDecode) {
      return absl::InvalidArgumentError(
          "--view packed answers an AppendBatch (--mode decode); an Append stream answers one sequence");
    }
    options.view = v1::SEQUENCE_VIEW_PACKED;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--view ", Quote(view), " is not full, basic, compact, lengths or packed"));
  }
  if (absl::GetFlag(FLAGS_rows_per_message) < 1 || absl::GetFlag(FLAGS_layers) < 1 ||
      absl::GetFlag(FLAGS_sequences) < 1 || absl::GetFlag(FLAGS_concurrency) < 1) {
    return absl::InvalidArgumentError("--concurrency, --rows_per_message, --layers and --sequences must be >= 1");
  }
  options.concurrency = absl::GetFlag(FLAGS_concurrency);
  options.connections = absl::GetFlag(FLAGS_connections);
  options.rows_per_message = static_cast<uint32_t>(absl::GetFlag(FLAGS_rows_per_message));
  options.batch_fraction = absl::GetFlag(FLAGS_batch_fraction);
  options.sequences = static_cast<uint32_t>(absl::GetFlag(FLAGS_sequences));
  options.compact = absl::GetFlag(FLAGS_compact);
  options.layers = static_cast<uint32_t>(absl::GetFlag(FLAGS_layers));
  options.duration_s = absl::GetFlag(FLAGS_duration_s);
  options.requests = absl::GetFlag(FLAGS_requests);
  if (options.duration_s < 0 || options.requests < 0 || (options.duration_s == 0 && options.requests == 0)) {
    return absl::InvalidArgumentError("the run must be bounded: --duration_s > 0 or --requests > 0");
  }
  options.pool = absl::GetFlag(FLAGS_pool);
  // Unique enough that two runs against one server never share a sequence.
  options.id_prefix = absl::StrCat("bench-", getpid(), "-",
                                   std::chrono::steady_clock::now().time_since_epoch().count() % 1000000);
  return options;
}

nlohmann::json ResultJson(const LoadOptions& options, const LoadResult& r, uint32_t context_tokens) {
  nlohmann::json errors = nlohmann::json::object();
  for (const auto& [code, n] : r.errors_by_code) {
    errors[code] = {{"count", n}, {"first_message", r.first_error_message.at(code)}};
  }
  return {{"mode", options.mode == LoadOptions::Mode::kDecode ? "decode" : "append"},
          {"concurrency", options.concurrency},
          {"connections", options.connections == 0 ? options.concurrency : options.connections},
          {"rows_per_request_per_layer", options.mode == LoadOptions::Mode::kDecode ? 1 : options.rows_per_message},
          {"sequences_per_request", options.mode == LoadOptions::Mode::kDecode ? options.sequences : 1},
          {"compact", options.mode == LoadOptions::Mode::kDecode && options.compact},
          {"view", v1::SequenceView_Name(options.view)},
          {"layers", options.layers},
          {"batch_fraction", options.batch_fraction},
          {"context_tokens", context_tokens},
          {"requests", r.requests},
          {"errors", r.errors},
          {"seconds", r.seconds},
          {"requests_per_s", r.seconds > 0 ? r.requests / r.seconds : 0},
          {"row_bytes", r.row_bytes},
          {"rows", r.rows},
          {"response_bytes_per_request", r.requests > r.errors ? r.response_bytes / (r.requests - r.errors) : 0},
          {"gb_per_s", r.seconds > 0 ? r.row_bytes / r.seconds / 1e9 : 0},
          {"latency_us",
           {{"p50", r.LatencyPercentile(50)}, {"p90", r.LatencyPercentile(90)}, {"p99", r.LatencyPercentile(99)},
            {"max", r.latency_us.empty() ? 0 : r.latency_us.back()}}},
          {"errors_by_code", errors},
          {"sequences_freed", r.sequences_freed},
          {"cleanup_error", r.cleanup_error}};
}

void PrintText(const nlohmann::json& j) {
  std::printf("mode %s: %d worker(s) on %d connection(s), %s per request\n", j["mode"].get<std::string>().c_str(),
              j["concurrency"].get<int>(), j["connections"].get<int>(),
              absl::StrCat(j["sequences_per_request"].get<int>(), " sequence(s) x ",
                           j["rows_per_request_per_layer"].get<int>(), " row(s) x ", j["layers"].get<int>(),
                           " layer(s)")
                  .c_str());
  std::printf("requests   %lld in %.2f s: %.1f requests/s, %lld error(s)\n", j["requests"].get<long long>(),
              j["seconds"].get<double>(), j["requests_per_s"].get<double>(), j["errors"].get<long long>());
  std::printf("rows       %lld rows, %.3f GB of input rows: %.3f GB/s\n", j["rows"].get<long long>(),
              j["row_bytes"].get<double>() / 1e9, j["gb_per_s"].get<double>());
  const nlohmann::json& l = j["latency_us"];
  std::printf("latency    p50 %.0f us, p90 %.0f us, p99 %.0f us, max %.0f us\n", l["p50"].get<double>(),
              l["p90"].get<double>(), l["p99"].get<double>(), l["max"].get<double>());
  std::printf("responses  %lld bytes each (%s)\n", j["response_bytes_per_request"].get<long long>(),
              j["view"].get<std::string>().c_str());
  for (const auto& [code, e] : j["errors_by_code"].items()) {
    std::printf("errors     %s x %lld (first: %s)\n", code.c_str(), e["count"].get<long long>(),
                e["first_message"].get<std::string>().c_str());
  }
  std::printf("cleanup    %d sequence(s) freed%s\n", j["sequences_freed"].get<int>(),
              j["cleanup_error"].get<std::string>().empty()
                  ? ""
                  : absl::StrCat("; ", j["cleanup_error"].get<std::string>()).c_str());
}

}  // namespace

int RunBench(const std::vector<std::string>& args) {
  if (!args.empty()) return UsageError(kUsage, "mlakv bench takes no positional arguments");
  absl::StatusOr<LoadOptions> options = OptionsFromFlags();
  if (!options.ok()) return UsageError(kUsage, absl::StrCat("mlakv bench: ", options.status().message()));
  absl::StatusOr<KvCacheClient::Options> client_options = ClientOptionsFromFlags();
  if (!client_options.ok()) return Fail("bench", client_options.status());
  absl::StatusOr<std::unique_ptr<LoadGenerator>> generator = LoadGenerator::Create(*client_options, *options);
  if (!generator.ok()) return Fail("bench", generator.status());

  g_stop.store(false);
  std::signal(SIGINT, OnInterrupt);
  std::atomic<bool> done{false};
  std::thread progress([&] {
    const auto begin = std::chrono::steady_clock::now();
    const LoadProgress& p = (*generator)->progress();
    while (!done.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
      std::fprintf(stderr, "\r[%6.1f s] %lld requests  %.1f req/s  %.3f GB/s  %lld error(s)   ", s,
                   static_cast<long long>(p.requests.load()), p.requests.load() / s, p.row_bytes.load() / s / 1e9,
                   static_cast<long long>(p.errors.load()));
    }
    std::fprintf(stderr, "\n");
  });
  const LoadResult result = (*generator)->Run(g_stop);
  done.store(true);
  progress.join();
  std::signal(SIGINT, SIG_DFL);

  const nlohmann::json summary = ResultJson(*options, result, (*generator)->context_tokens());
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", summary.dump().c_str());
  } else {
    PrintText(summary);
  }
  // Failed requests or a failed cleanup make the run a failure (after the summary).
  return result.errors == 0 && result.cleanup_error.empty() ? kExitOk : kExitFailed;
}

}  // namespace mlakv::cli
