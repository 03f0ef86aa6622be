#include "client/load_generator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace mlakv {
namespace {

constexpr size_t kCkvDim = 512;
constexpr size_t kKpeDim = 64;
// Scales the bench names for a layer that has none yet; they suit the values
// of RandomRowBytes (|x| < 8): 8 / (6 x 448) and 8 / 448.
constexpr float kBenchCkvScale = 8.0f / (6.0f * 448.0f);
constexpr float kBenchKpeScale = 8.0f / 448.0f;

}  // namespace

std::string RandomRowBytes(size_t count, v1::RowDType dtype, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string bytes(count * 2, '\0');
  for (size_t i = 0; i < count; ++i) {
    const uint64_t r = rng();
    const uint16_t sign = (r & 1) << 15;
    uint16_t bits;
    if (dtype == v1::ROW_DTYPE_FLOAT16) {
      const uint16_t exponent = 10 + (r >> 1) % 8;  // bias 15
      bits = sign | exponent << 10 | ((r >> 8) & 0x3ff);
    } else {
      const uint16_t exponent = 122 + (r >> 1) % 8;  // bias 127
      bits = sign | exponent << 7 | ((r >> 8) & 0x7f);
    }
    bytes[2 * i] = static_cast<char>(bits & 0xff);
    bytes[2 * i + 1] = static_cast<char>(bits >> 8);
  }
  return bytes;
}

struct LoadGenerator::Worker {
  // Random rows (ckv, kpe), reused by every request and layer; shared so
  // that Append sends them by reference (AppendRows::rows_owner) and gRPC may
  // hold them past the run.
  std::shared_ptr<const std::pair<std::string, std::string>> random_rows;
  // Prebuilt AppendBatch; only starts change. Shared: its rows are sent by
  // reference (KvCacheClient::AppendBatch), and gRPC may hold them past the call.
  std::shared_ptr<v1::AppendBatchRequest> batch = std::make_shared<v1::AppendBatchRequest>();
  std::vector<double> latency_us;
  std::map<std::string, int64_t> errors_by_code;
  std::map<std::string, std::string> first_error_message;
  int64_t requests = 0, errors = 0, row_bytes = 0, rows = 0, response_bytes = 0;
  std::string free_error;  // first failed free when the sequences were recycled
};

double LoadResult::LatencyPercentile(double p) const {
  if (latency_us.empty()) return 0;
  const size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * latency_us.size()));
  return latency_us[std::clamp<size_t>(rank, 1, latency_us.size()) - 1];
}

absl::StatusOr<std::unique_ptr<LoadGenerator>> LoadGenerator::Create(const KvCacheClient::Options& client_options,
                                                                     const LoadOptions& options) {
  if (options.concurrency < 1) return absl::InvalidArgumentError("bench: concurrency must be >= 1");
  if (options.duration_s <= 0 && options.requests <= 0) {
    return absl::InvalidArgumentError("bench: give a bound, duration_s > 0 or requests > 0");
  }
  if (options.layers < 1) return absl::InvalidArgumentError("bench: layers must be >= 1");
  if (RowDTypeBytes(options.dtype) == 0) return absl::InvalidArgumentError("bench: dtype must be f16 or bf16");
  if (options.batch_fraction < 0 || options.batch_fraction > 1) {
    return absl::InvalidArgumentError("bench: batch_fraction must be in [0, 1]");
  }
  const bool decode = options.mode == LoadOptions::Mode::kDecode;
  if (decode && options.sequences < 1) return absl::InvalidArgumentError("bench: sequences must be >= 1");
  if (!decode && options.rows_per_message < 1) return absl::InvalidArgumentError("bench: rows_per_message must be >= 1");

  if (options.connections < 0 || options.connections > options.concurrency) {
    return absl::InvalidArgumentError(absl::StrCat("bench: connections must be in [0, concurrency = ",
                                                   options.concurrency, "], got ", options.connections));
  }
  std::vector<std::unique_ptr<KvCacheClient>> clients;
  const int connections = options.connections == 0 ? options.concurrency : options.connections;
  for (int i = 0; i < connections; ++i) {
    MLAKV_ASSIGN_OR_RETURN(std::unique_ptr<KvCacheClient> client, KvCacheClient::Create(client_options));
    clients.push_back(std::move(client));
  }
  MLAKV_ASSIGN_OR_RETURN(v1::Pool pool, clients[0]->GetPool(options.pool));
  if (options.layers > pool.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("bench: layers ", options.layers, " but pool ", pool.name(),
                                                   " has ", pool.num_layers()));
  }
  // Each sequence gets an equal share of 3/4 of the free pages.
  const uint64_t sequences = uint64_t(options.concurrency) * (decode ? options.sequences : 1);
  const uint64_t pages_each = pool.pages_free() * 3ull / 4 / sequences;
  const uint32_t context_tokens = static_cast<uint32_t>(std::min<uint64_t>(pages_each * pool.page_size(), 1u << 30));
  const uint32_t rows = decode ? 1 : options.rows_per_message;
  if (context_tokens < rows) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "bench: pool ", pool.name(), " has ", pool.pages_free(), " free pages of ", pool.page_size(),
        " tokens; ", sequences, " sequence(s) of ", rows, " tokens need ",
        sequences * ((rows + pool.page_size() - 1) / pool.page_size()), " (using at most 3/4 of the free pages)"));
  }
  std::vector<float> ckv_scales, kpe_scales;
  for (uint32_t layer = 0; layer < options.layers; ++layer) {
    const bool set = static_cast<int>(layer) < pool.layers_size() && pool.layers(layer).set();
    ckv_scales.push_back(set ? pool.layers(layer).ckv_scale() : kBenchCkvScale);
    kpe_scales.push_back(set ? pool.layers(layer).kpe_scale() : kBenchKpeScale);
  }
  return std::unique_ptr<LoadGenerator>(
      new LoadGenerator(options, std::move(clients), context_tokens, std::move(ckv_scales), std::move(kpe_scales)));
}

LoadGenerator::LoadGenerator(LoadOptions options, std::vector<std::unique_ptr<KvCacheClient>> clients,
                             uint32_t context_tokens, std::vector<float> ckv_scales, std::vector<float> kpe_scales)
    : options_(std::move(options)),
      clients_(std::move(clients)),
      context_tokens_(context_tokens),
      ckv_scales_(std::move(ckv_scales)),
      kpe_scales_(std::move(kpe_scales)) {}

std::string LoadGenerator::SequenceId(int worker, uint32_t index) const {
  return absl::StrCat(options_.id_prefix, "-w", worker, "-s", index);
}

void LoadGenerator::RunWorker(int index, const std::atomic<bool>& stop, std::atomic<int64_t>& issued,
                              Worker& worker) {
  KvCacheClient& client = *clients_[index % clients_.size()];  // a client is one connection, safe to share
  const bool decode = options_.mode == LoadOptions::Mode::kDecode;
  const uint32_t rows = decode ? 1 : options_.rows_per_message;
  const uint32_t sequences = decode ? options_.sequences : 1;
  const size_t element = RowDTypeBytes(options_.dtype);
  const int64_t request_row_bytes = int64_t{rows} * sequences * options_.layers * (kCkvDim + kKpeDim) * element;

  // Random rows: `rows` rows for append, one row per sequence for decode.
  const size_t buffer_rows = decode ? sequences : rows;
  worker.random_rows = std::make_shared<const std::pair<std::string, std::string>>(
      RandomRowBytes(buffer_rows * kCkvDim, options_.dtype, 2 * index + 1),
      RandomRowBytes(buffer_rows * kKpeDim, options_.dtype, 2 * index + 2));
  const std::string& ckv = worker.random_rows->first;
  const std::string& kpe = worker.random_rows->second;

  worker.batch->set_pool(options_.pool);
  worker.batch->set_dtype(options_.dtype);
  worker.batch->set_view(options_.view);
  for (uint32_t s = 0; s < sequences; ++s) {
    v1::SequenceRows* seq = worker.batch->add_sequences();
    seq->set_sequence(SequenceId(index, s));
    seq->set_row_count(rows);
    const size_t row0 = decode ? s : 0;
    for (uint32_t layer = 0; layer < options_.layers && !(decode && options_.compact); ++layer) {
      v1::LayerRows* l = seq->add_layers();
      l->set_layer(layer);
      l->set_ckv(ckv.substr(row0 * kCkvDim * element, size_t{rows} * kCkvDim * element));
      l->set_kpe(kpe.substr(row0 * kKpeDim * element, size_t{rows} * kKpeDim * element));
      l->set_ckv_scale(ckv_scales_[layer]);
      l->set_kpe_scale(kpe_scales_[layer]);
    }
  }
  // The compact form: each layer's rows of all the step's sequences in one
  // entry (sequence s's row is row s of the buffer).
  for (uint32_t layer = 0; layer < options_.layers && decode && options_.compact; ++layer) {
    v1::LayerRows* l = worker.batch->add_batch_layers();
    l->set_layer(layer);
    l->set_ckv(ckv);
    l->set_kpe(kpe);
    l->set_ckv_scale(ckv_scales_[layer]);
    l->set_kpe_scale(kpe_scales_[layer]);
  }
  AppendRows append;
  append.pool = options_.pool;
  append.sequence = SequenceId(index, 0);
  append.rows = rows;
  append.dtype = options_.dtype;
  append.rows_owner = worker.random_rows;
  append.view = options_.view;
  for (uint32_t layer = 0; layer < options_.layers && !decode; ++layer) {  // decode sends only AppendBatch
    append.layers.push_back({layer, ckv, kpe, ckv_scales_[layer], kpe_scales_[layer]});
  }

  std::mt19937_64 rng(1000 + index);
  std::uniform_real_distribution<double> unit(0, 1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(options_.duration_s);
  uint32_t position = 0;
  while (!stop.load(std::memory_order_relaxed)) {
    if (options_.duration_s > 0 && std::chrono::steady_clock::now() >= deadline) break;
    if (options_.requests > 0 && issued.fetch_add(1) >= options_.requests) break;
    if (position + rows > context_tokens_) {
      // The sequences are full: free them (untimed) and start fresh ones, as
      // new requests would; a run of any length holds a bounded number of pages.
      for (uint32_t s = 0; s < sequences; ++s) {
        absl::StatusOr<uint32_t> freed = client.Free(options_.pool, SequenceId(index, s));
        if (!freed.ok() && !absl::IsNotFound(freed.status()) && worker.free_error.empty()) {
          worker.free_error = absl::StrCat("free ", SequenceId(index, s), ": ",
                                           absl::StatusCodeToString(freed.status().code()), ": ",
                                           freed.status().message());
        }
      }
      position = 0;
    }
    const bool use_batch = decode || unit(rng) < options_.batch_fraction;

    const auto begin = std::chrono::steady_clock::now();
    absl::Status status;
    size_t response_bytes = 0;  // measured after the clock stops
    if (use_batch) {
      for (v1::SequenceRows& seq : *worker.batch->mutable_sequences()) seq.set_start(position);
      absl::StatusOr<v1::AppendBatchResponse> response =
          client.AppendBatch(std::shared_ptr<const v1::AppendBatchRequest>(worker.batch));
      status = response.status();
      if (response.ok()) response_bytes = response->ByteSizeLong();
    } else {
      append.start = position;
      absl::StatusOr<v1::AppendResponse> response = client.Append(append);
      status = response.status();
      if (response.ok()) response_bytes = response->ByteSizeLong();
    }
    const double micros = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - begin).count();

    worker.latency_us.push_back(micros);
    ++worker.requests;
    progress_.requests.fetch_add(1, std::memory_order_relaxed);
    if (status.ok()) {
      worker.row_bytes += request_row_bytes;
      worker.rows += int64_t{rows} * sequences * options_.layers;
      worker.response_bytes += static_cast<int64_t>(response_bytes);
      progress_.row_bytes.fetch_add(request_row_bytes, std::memory_order_relaxed);
      position += rows;
    } else {
      ++worker.errors;
      progress_.errors.fetch_add(1, std::memory_order_relaxed);
      const std::string code = absl::StatusCodeToString(status.code());
      if (worker.errors_by_code[code]++ == 0) worker.first_error_message[code] = std::string(status.message());
    }
  }
}

LoadResult LoadGenerator::Run(const std::atomic<bool>& stop) {
  std::vector<Worker> workers(static_cast<size_t>(options_.concurrency));
  std::atomic<int64_t> issued{0};
  const auto begin = std::chrono::steady_clock::now();
  {
    std::vector<std::jthread> threads;
    for (size_t i = 0; i < workers.size(); ++i) {
      threads.emplace_back([&, i] { RunWorker(static_cast<int>(i), stop, issued, workers[i]); });
    }
  }
  LoadResult result;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  for (Worker& w : workers) {
    result.requests += w.requests;
    result.errors += w.errors;
    result.row_bytes += w.row_bytes;
    result.rows += w.rows;
    result.response_bytes += w.response_bytes;
    result.latency_us.insert(result.latency_us.end(), w.latency_us.begin(), w.latency_us.end());
    for (const auto& [code, n] : w.errors_by_code) result.errors_by_code[code] += n;
    result.first_error_message.insert(w.first_error_message.begin(), w.first_error_message.end());
  }
  std::sort(result.latency_us.begin(), result.latency_us.end());
  for (const Worker& w : workers) {
    if (result.cleanup_error.empty()) result.cleanup_error = w.free_error;
  }

  // Free everything this run may have created; NOT_FOUND means it never was.
  const uint32_t sequences = options_.mode == LoadOptions::Mode::kDecode ? options_.sequences : 1;
  for (size_t w = 0; w < static_cast<size_t>(options_.concurrency); ++w) {
    for (uint32_t s = 0; s < sequences; ++s) {
      absl::StatusOr<uint32_t> freed =
          clients_[w % clients_.size()]->Free(options_.pool, SequenceId(static_cast<int>(w), s));
      if (freed.ok()) {
        ++result.sequences_freed;
      } else if (!absl::IsNotFound(freed.status()) && result.cleanup_error.empty()) {
        result.cleanup_error = absl::StrCat("free ", SequenceId(static_cast<int>(w), s), ": ",
                                            absl::StatusCodeToString(freed.status().code()), ": ",
                                            freed.status().message());
      }
    }
  }
  return result;
}

}  // namespace mlakv
