// LoadGenerator: the engine of `mlakv bench`. Workers, each with its own
// KvCacheClient (its own connection), send random non-zero rows to a running
// server until a time or request bound, record every request's latency and
// status, and free every sequence they created before returning.
//
// Two shapes of load:
//  - append: each request writes `rows_per_message` rows x `layers` layers to
//    the worker's own sequence, as an Append stream (chunked by the client to
//    ~4 MB messages) or, for a `batch_fraction` share, as an AppendBatch;
//  - decode: each request is one AppendBatch of `sequences` sequences x 1
//    token x `layers` layers (one decode step of a batch).
// Positions advance with every request; before a sequence outgrows its share
// of the pool's free pages, the worker frees its sequences (outside the timed
// request) and starts again at 0, so every append writes fresh positions, as
// new prefills do, and a run of any length holds a bounded number of pages.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/kv_cache_client.h"

namespace mlakv {

struct LoadOptions {
  enum class Mode { kAppend, kDecode };
  Mode mode = Mode::kAppend;
  int concurrency = 1;             // workers, each with one request in flight at a time
  int connections = 0;             // TCP connections the workers share round-robin (0: one per worker);
                                   // workers > connections multiplex streams over one HTTP/2 connection
  uint32_t rows_per_message = 3584;  // append: rows per request per layer (3584 x 1152 B = 3.94 MiB: one message)
  double batch_fraction = 0;       // append: share of requests sent as AppendBatch, [0, 1]
  uint32_t sequences = 256;        // decode: sequences per AppendBatch (per worker)
  bool compact = false;            // decode: AppendBatch's compact form (one batch_layers entry per layer)
  v1::SequenceView view = v1::SEQUENCE_VIEW_FULL;  // what every response's sequences carry
  uint32_t layers = 1;             // layers 0..layers-1 written by every request
  v1::RowDType dtype = v1::ROW_DTYPE_BFLOAT16;
  double duration_s = 10;          // stop after this many seconds (0: no time bound)
  int64_t requests = 0;            // stop after this many requests in all (0: no count bound)
  std::string pool;                // empty: the server's default pool
  std::string id_prefix;           // sequence ids are id_prefix + "-w<worker>-s<index>"
};

// `count` random non-zero finite fp16 or bf16 values (random sign and
// mantissa, magnitudes in [2^-5, 2^3)), as little-endian bytes.
std::string RandomRowBytes(size_t count, v1::RowDType dtype, uint64_t seed);

// Counters the workers update while they run (read them for a progress line).
struct LoadProgress {
  std::atomic<int64_t> requests{0};
  std::atomic<int64_t> errors{0};
  std::atomic<int64_t> row_bytes{0};  // input row bytes of successful requests
};

struct LoadResult {
  int64_t requests = 0;   // sent, successful or not
  int64_t errors = 0;
  int64_t row_bytes = 0;  // input row bytes (ckv + kpe) of successful requests
  int64_t rows = 0;       // rows (per layer, summed over layers) of successful requests
  int64_t response_bytes = 0;  // serialized size of the successful requests' responses, summed
  double seconds = 0;     // wall time of the load phase
  std::vector<double> latency_us;                 // every request, sorted ascending
  std::map<std::string, int64_t> errors_by_code;  // "RESOURCE_EXHAUSTED" -> count
  std::map<std::string, std::string> first_error_message;  // per code
  int sequences_freed = 0;
  std::string cleanup_error;  // empty when every free (recycling and final cleanup) succeeded

  // Nearest-rank percentile of latency_us (0 when there were no requests).
  double LatencyPercentile(double p) const;
};

class LoadGenerator {
 public:
  // Connects `options.concurrency` clients and reads the pool's geometry and
  // scales; refuses bounds or shapes that cannot run.
  static absl::StatusOr<std::unique_ptr<LoadGenerator>> Create(const KvCacheClient::Options& client_options,
                                                               const LoadOptions& options);

  // Runs until the bound is reached or `stop` turns true, then frees every
  // sequence the run created.
  LoadResult Run(const std::atomic<bool>& stop);

  const LoadProgress& progress() const { return progress_; }
  // Tokens each sequence reaches before the worker frees it and starts over.
  uint32_t context_tokens() const { return context_tokens_; }

 private:
  struct Worker;
  LoadGenerator(LoadOptions options, std::vector<std::unique_ptr<KvCacheClient>> clients, uint32_t context_tokens,
                std::vector<float> ckv_scales, std::vector<float> kpe_scales);
  void RunWorker(int index, const std::atomic<bool>& stop, std::atomic<int64_t>& issued, Worker& worker);
  std::string SequenceId(int worker, uint32_t index) const;

  LoadOptions options_;
  std::vector<std::unique_ptr<KvCacheClient>> clients_;
  uint32_t context_tokens_;
  std::vector<float> ckv_scales_, kpe_scales_;  // per layer written
  LoadProgress progress_;
};

}  // namespace mlakv
