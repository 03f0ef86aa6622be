// IPC append end to end vs the kernel alone (issue 6's measurement).
//
//   ipc_append_bench --server ADDR [--rows 262144] [--repeats 20]
//   ipc_append_bench --server ADDR --decode_step [--sequences 256] [--layers 61] [--repeats 200] [--context N] [--basic_only] [--shm] [--spin]
//
// Acts as a prefill worker on the same GPU as a running
// `mlakv-server --allow_ipc --device cuda:0` (a separate process: a CUDA IPC
// handle cannot be opened by the process that exported it). It cudaMallocs
// --rows bf16 rows (ckv then kpe), registers them as a CUDA region, then
// times RPCs that name the region instead of carrying bytes — an Append
// stream of one message and a unary AppendBatch (in the default view FULL,
// and in LENGTHS, which leaves the page table out of the response), client
// call to response, one layer, fresh positions each time (the sequence is freed, untimed, between
// calls) — against the kernel alone on the same rows in this process (CUDA
// events), and a GetPool call as the floor of any RPC. Medians of --repeats.
//
// --decode_step: a decode step by reference (issue 16): --sequences
// sequences x 1 token x --layers layers per AppendBatch in the compact form,
// each layer's rows of all sequences one range of the region, timed end to
// end (p50 / p99 over --repeats steps at fresh positions), against the
// kernel alone for the same step in this process (all layers in one launch,
// and one launch per layer) and a device copy of the step's bytes (the
// kernel's byte floor: 1512 bytes read + written per row), each timed from an
// L2 cleared by an untimed write of twice its size. The steps
// rotate through the response views BASIC, COMPACT and PACKED (--basic_only:
// BASIC alone, for a server that predates COMPACT; a server that predates
// PACKED refuses the third view: time it with the bench of its own tree). --shm: the rows in a
// host shared-memory region instead (no GPU here; the kernel comparison is
// skipped), for a server with a cpu pool. --spin: each AppendBatch of the
// steps waited for by polling its own completion queue without sleeping.
// --context N: every sequence first holds N tokens (one untimed AppendBatch
// per sequence from the region's first N rows, N <= sequences x layers), so
// the steps meet the page tables of an N-token context.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_cuda_check.h"
#include "kernels/quantize_append.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"

namespace {


double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

double Us(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// Random bf16 bits, never zero.
std::vector<uint16_t> RandomBf16(size_t n, uint32_t seed) {
  std::vector<uint16_t> host(n);
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (auto& h : host) {
    const float f = g(rng) + 0.01f;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    h = static_cast<uint16_t>(u >> 16);
  }
  return host;
}

bool RegisterRegion(mlakv::v1::KvCache::Stub& stub, const std::string& name, void* dev, size_t bytes) {
  cudaIpcMemHandle_t handle;
  CHECK_CUDA(cudaIpcGetMemHandle(&handle, dev));
  mlakv::v1::RegisterCudaRegionRequest req;
  req.set_name(name);
  req.set_raw_handle(std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
  req.set_device_id(0);
  req.set_byte_size(bytes);
  mlakv::v1::Region resp;
  grpc::ClientContext ctx;
  const grpc::Status s = stub.RegisterCudaRegion(&ctx, req, &resp);
  if (!s.ok()) std::fprintf(stderr, "RegisterCudaRegion: %s\n", s.error_message().c_str());
  return s.ok();
}

void UnregisterRegion(mlakv::v1::KvCache::Stub& stub, const std::string& name) {
  mlakv::v1::UnregisterRegionRequest req;
  req.set_name(name);
  mlakv::v1::UnregisterRegionResponse resp;
  grpc::ClientContext ctx;
  stub.UnregisterRegion(&ctx, req, &resp);
}

// The decode step by reference. Region layout: every layer's ckv rows
// (layer L's [sequences, 512] at L x sequences x 1024 bytes), then every
// layer's kpe rows.
// Host rows in a POSIX shared-memory object, registered as a shm region (the
// --shm form of the decode step: no GPU needed, e.g. against a cpu pool).
struct ShmRows {
  std::string shm_name;
  void* base = nullptr;
  size_t bytes = 0;
  ~ShmRows() {
    if (base != nullptr) munmap(base, bytes);
    if (!shm_name.empty()) shm_unlink(shm_name.c_str());
  }
};

bool RegisterShmRows(mlakv::v1::KvCache::Stub& stub, const std::string& name, const std::vector<uint16_t>& host,
                     ShmRows* out) {
  out->shm_name = "/mlakv-ipc-bench-" + std::to_string(getpid());
  out->bytes = host.size() * 2;
  const int fd = shm_open(out->shm_name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(out->bytes)) != 0) {
    std::perror("shm_open/ftruncate");
    if (fd >= 0) close(fd);
    return false;
  }
  out->base = mmap(nullptr, out->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (out->base == MAP_FAILED) {
    out->base = nullptr;
    std::perror("mmap");
    return false;
  }
  std::memcpy(out->base, host.data(), out->bytes);
  mlakv::v1::RegisterShmRegionRequest req;
  req.set_name(name);
  req.set_shm_name(out->shm_name);
  req.set_byte_size(out->bytes);
  mlakv::v1::Region resp;
  grpc::ClientContext ctx;
  const grpc::Status s = stub.RegisterShmRegion(&ctx, req, &resp);
  if (!s.ok()) std::fprintf(stderr, "RegisterShmRegion: %s\n", s.error_message().c_str());
  return s.ok();
}

void PrintSteps(int sequences, int layers, size_t rows, int repeats, const std::vector<double>& step_us,
                const std::vector<double>& compact_us, const std::vector<double>& packed_us,
                const std::vector<double>& get_pool_us, bool with_compact) {
  std::printf("decode step by reference: %d sequences x 1 token x %d layers (%zu rows), %d steps\n", sequences,
              layers, rows, repeats);
  std::printf("  AppendBatch compact end to end: p50 %.1f us, p90 %.1f us, p99 %.1f us (min %.1f); GetPool p50 %.1f us\n",
              Median(step_us), Percentile(step_us, 0.9), Percentile(step_us, 0.99),
              *std::min_element(step_us.begin(), step_us.end()), Median(get_pool_us));
  if (with_compact) {
    std::printf("    the same, view COMPACT (steps interleaved): p50 %.1f us, p90 %.1f us, p99 %.1f us (min %.1f)\n",
                Median(compact_us), Percentile(compact_us, 0.9), Percentile(compact_us, 0.99),
                *std::min_element(compact_us.begin(), compact_us.end()));
    std::printf("    the same, view PACKED (steps interleaved): p50 %.1f us, p90 %.1f us, p99 %.1f us (min %.1f)\n",
                Median(packed_us), Percentile(packed_us, 0.9), Percentile(packed_us, 0.99),
                *std::min_element(packed_us.begin(), packed_us.end()));
  }
}

// One AppendBatch whose caller spins for the answer (--spin): the call on a
// completion queue of its own, polled without waiting, so that the answer is
// read at once instead of after this thread wakes (a decode worker that
// waits for its step's append anyway).
grpc::Status SpinningAppendBatch(mlakv::v1::KvCache::Stub& stub, grpc::ClientContext* ctx,
                                 const mlakv::v1::AppendBatchRequest& req, mlakv::v1::AppendBatchResponse* resp,
                                 grpc::CompletionQueue* cq) {
  grpc::Status status;
  auto call = stub.PrepareAsyncAppendBatch(ctx, req, cq);
  call->StartCall();
  call->Finish(resp, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  while (cq->AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC)) != grpc::CompletionQueue::GOT_EVENT) {
    std::this_thread::yield();
  }
  return ok ? status : grpc::Status(grpc::StatusCode::INTERNAL, "the call's completion came back not ok");
}

// Appends `context` rows to each of `sequences` sequences in every layer, from
// the first rows of region `region` (ckv at 0, kpe at `kpe_offset`).
bool FillContext(mlakv::v1::KvCache::Stub& stub, const std::string& region, uint64_t kpe_offset, int sequences,
                 int layers, int context, const std::function<std::string(int)>& id) {
  for (int s = 0; s < sequences; ++s) {
    mlakv::v1::AppendBatchRequest req;
    req.set_dtype(mlakv::v1::ROW_DTYPE_BFLOAT16);
    req.set_view(mlakv::v1::SEQUENCE_VIEW_LENGTHS);
    mlakv::v1::SequenceRows* seq = req.add_sequences();
    seq->set_sequence(id(s));
    seq->set_row_count(static_cast<uint32_t>(context));
    for (int l = 0; l < layers; ++l) {
      mlakv::v1::LayerRows* lr = req.add_batch_layers();
      lr->set_layer(static_cast<uint32_t>(l));
      lr->set_ckv_scale(0.02f);
      lr->set_kpe_scale(0.05f);
      lr->mutable_ckv_ref()->set_region(region);
      lr->mutable_kpe_ref()->set_region(region);
      lr->mutable_kpe_ref()->set_offset(kpe_offset);
    }
    mlakv::v1::AppendBatchResponse resp;
    grpc::ClientContext ctx;
    if (const grpc::Status st = stub.AppendBatch(&ctx, req, &resp); !st.ok()) {
      std::fprintf(stderr, "AppendBatch (context of %s): %d: %s\n", id(s).c_str(), static_cast<int>(st.error_code()),
                   st.error_message().c_str());
      return false;
    }
  }
  return true;
}

int RunDecodeStep(mlakv::v1::KvCache::Stub& stub, int sequences, int layers, int repeats, int context,
                  bool with_compact, bool shm, bool spin) {
  grpc::CompletionQueue spin_cq;
  struct DrainAtExit {
    grpc::CompletionQueue* cq;
    ~DrainAtExit() {
      cq->Shutdown();
      void* tag;
      bool ok;
      while (cq->Next(&tag, &ok)) {
      }
    }
  } drain{&spin_cq};
  const size_t rows = static_cast<size_t>(sequences) * layers;
  const size_t ckv_bytes = rows * 1024, kpe_bytes = rows * 128;
  const std::vector<uint16_t> host = RandomBf16((ckv_bytes + kpe_bytes) / 2, 11);
  void* rows_dev = nullptr;
  ShmRows shm_rows;
  if (shm) {
    if (!RegisterShmRows(stub, "ipc-decode", host, &shm_rows)) return 1;
  } else {
    CHECK_CUDA(cudaSetDevice(0));
    CHECK_CUDA(cudaMalloc(&rows_dev, ckv_bytes + kpe_bytes));
    CHECK_CUDA(cudaMemcpy(rows_dev, host.data(), ckv_bytes + kpe_bytes, cudaMemcpyHostToDevice));
    if (!RegisterRegion(stub, "ipc-decode", rows_dev, ckv_bytes + kpe_bytes)) return 1;
  }
  const std::function<std::string(int)> id = [](int s) { return "decode-" + std::to_string(s); };
  if (context > 0 && !FillContext(stub, "ipc-decode", ckv_bytes, sequences, layers, context, id)) return 1;
  mlakv::v1::AppendBatchRequest req;
  req.set_dtype(mlakv::v1::ROW_DTYPE_BFLOAT16);
  req.set_view(mlakv::v1::SEQUENCE_VIEW_BASIC);
  for (int s = 0; s < sequences; ++s) {
    mlakv::v1::SequenceRows* seq = req.add_sequences();
    seq->set_sequence(id(s));
    seq->set_row_count(1);
  }
  for (int l = 0; l < layers; ++l) {
    mlakv::v1::LayerRows* lr = req.add_batch_layers();
    lr->set_layer(static_cast<uint32_t>(l));
    lr->set_ckv_scale(0.02f);
    lr->set_kpe_scale(0.05f);
    lr->mutable_ckv_ref()->set_region("ipc-decode");
    lr->mutable_ckv_ref()->set_offset(static_cast<uint64_t>(l) * sequences * 1024);
    lr->mutable_kpe_ref()->set_region("ipc-decode");
    lr->mutable_kpe_ref()->set_offset(ckv_bytes + static_cast<uint64_t>(l) * sequences * 128);
  }
  // Steps rotate through the response's views BASIC, COMPACT (no names) and
  // PACKED (parallel arrays, no Sequence messages), so that all meet the
  // same host state.
  std::vector<double> step_us, compact_us, packed_us, get_pool_us;
  const int views = with_compact ? 3 : 1;
  for (int t = 0; t < views * repeats + 5; ++t) {
    const int v = t % views;
    const bool compact = v == 1, packed = v == 2;
    req.set_view(packed    ? mlakv::v1::SEQUENCE_VIEW_PACKED
                 : compact ? mlakv::v1::SEQUENCE_VIEW_COMPACT
                           : mlakv::v1::SEQUENCE_VIEW_BASIC);
    const uint32_t length = static_cast<uint32_t>(context + t);  // before the step
    for (mlakv::v1::SequenceRows& seq : *req.mutable_sequences()) {
      seq.set_start(length);
      seq.set_expect_length(length);
    }
    mlakv::v1::AppendBatchResponse resp;
    grpc::ClientContext ctx;
    const auto t0 = std::chrono::steady_clock::now();
    const grpc::Status s = spin ? SpinningAppendBatch(stub, &ctx, req, &resp, &spin_cq) : stub.AppendBatch(&ctx, req, &resp);
    const auto t1 = std::chrono::steady_clock::now();
    if (!s.ok()) {
      std::fprintf(stderr, "AppendBatch (compact, step %d): %d: %s\n", t, static_cast<int>(s.error_code()),
                   s.error_message().c_str());
      return 1;
    }
    const bool as_expected =
        packed ? resp.sequences_size() == 0 && resp.packed().lengths_size() == sequences &&
                     resp.packed().lengths(0) == length + 1
               : resp.sequences_size() == sequences && resp.sequences(0).id().empty() == compact &&
                     resp.sequences(0).length() == length + 1;
    if (!as_expected) {
      const bool any = resp.sequences_size() > 0;
      std::fprintf(stderr,
                   "AppendBatch (compact, step %d): unexpected response: %d sequences, first id '%s' length %u; "
                   "%d packed lengths\n",
                   t, resp.sequences_size(), any ? resp.sequences(0).id().c_str() : "",
                   any ? resp.sequences(0).length() : 0u, resp.packed().lengths_size());
      return 1;
    }
    if (t >= 5) (packed ? packed_us : compact ? compact_us : step_us).push_back(Us(t0, t1));
    mlakv::v1::GetPoolRequest preq;
    mlakv::v1::Pool presp;
    grpc::ClientContext pctx;
    const auto p0 = std::chrono::steady_clock::now();
    stub.GetPool(&pctx, preq, &presp);
    if (t >= 5) get_pool_us.push_back(Us(p0, std::chrono::steady_clock::now()));
  }
  for (int s = 0; s < sequences; ++s) {
    mlakv::v1::FreeSequenceRequest free_req;
    free_req.set_sequence(id(s));
    mlakv::v1::FreeSequenceResponse free_resp;
    grpc::ClientContext free_ctx;
    stub.FreeSequence(&free_ctx, free_req, &free_resp);
  }
  UnregisterRegion(stub, "ipc-decode");
  if (shm) {
    PrintSteps(sequences, layers, rows, repeats, step_us, compact_us, packed_us, get_pool_us, with_compact);
    return 0;
  }

  // The kernel alone for one step: sequence s owns page s of every layer
  // (page size 64) and appends at position 5; caches per layer as a pool has them.
  const int page_size = 64;
  const size_t entries = static_cast<size_t>(sequences) * page_size;
  std::vector<int32_t> idx;
  for (int s = 0; s <= sequences; ++s) idx.push_back(s);  // segment_indptr = kv_indptr = 0..S
  for (int s = 0; s < sequences; ++s) idx.push_back(s);   // segment_request = kv_indices = 0..S-1
  for (int s = 0; s < sequences; ++s) idx.push_back(5);   // segment_start
  int32_t* idx_dev = nullptr;
  uint8_t* caches = nullptr;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&idx_dev), idx.size() * 4));
  CHECK_CUDA(cudaMemcpy(idx_dev, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&caches), entries * 352 * layers));
  std::vector<mlakv::QuantizeAppendParams> params(layers);
  for (int l = 0; l < layers; ++l) {
    mlakv::QuantizeAppendParams& p = params[l];
    uint8_t* cache = caches + entries * 352 * l;
    p.append_ckv = static_cast<char*>(rows_dev) + static_cast<size_t>(l) * sequences * 1024;
    p.append_kpe = static_cast<char*>(rows_dev) + ckv_bytes + static_cast<size_t>(l) * sequences * 128;
    p.dtype = mlakv::DType::kBFloat16;
    p.num_rows = sequences;
    p.segment_indptr = idx_dev;
    p.segment_request = idx_dev + sequences + 1;
    p.segment_start = idx_dev + 2 * sequences + 1;
    p.num_segments = sequences;
    p.ckv_cache = cache;
    p.ckv_sf_cache = cache + entries * 256;
    p.kpe_cache = cache + entries * 288;
    p.num_pages = sequences;
    p.page_size = page_size;
    p.kv_indices = idx_dev + sequences + 1;
    p.kv_indptr = idx_dev;
    p.batch_size = sequences;
    p.num_kv_indices = sequences;
    p.ckv_scale = 0.02f;
    p.kpe_scale = 0.05f;
  }
  void* copy_dst = nullptr;
  const size_t copy_bytes = rows * 756;  // read + write = 1512 bytes per row
  CHECK_CUDA(cudaMalloc(&copy_dst, 2 * copy_bytes));
  // Each timed operation starts with the L2 cleared of its bytes: a buffer of
  // twice the L2's size is written just before (untimed). Without it the
  // copy's 11.8 MB source and destination stay in the L2 (50-60 MB here) from one
  // repetition to the next, and the kernel -- whose rows a decode worker's
  // forward pass wrote long before, among other traffic -- was compared with
  // an L2-resident copy (1.29-1.48x in earlier runs; quantize_append_bench's
  // decode_step cases rotate through buffers four L2s large instead).
  int l2_bytes = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, 0));
  const size_t flush_bytes = 2 * static_cast<size_t>(std::max(l2_bytes, 1 << 20));
  void* flush = nullptr;
  CHECK_CUDA(cudaMalloc(&flush, flush_bytes));
  int flushes = 0;
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  const auto time_us = [&](auto&& launch) {
    CHECK_CUDA(cudaMemsetAsync(flush, ++flushes & 0xff, flush_bytes));
    CHECK_CUDA(cudaEventRecord(a));
    launch();
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    return ms * 1000.0;
  };
  std::vector<double> one_launch, per_layer, copy;
  for (int i = 0; i < repeats + 5; ++i) {  // alternating, so clock drift reaches all three alike
    const double k1 = time_us([&] {
      if (!mlakv::QuantizeAppendLayers(params.data(), layers, nullptr).ok()) std::exit(1);
    });
    const double kl = time_us([&] {
      for (const auto& p : params) {
        if (!mlakv::QuantizeAppend(p, nullptr).ok()) std::exit(1);
      }
    });
    const double c = time_us([&] {
      CHECK_CUDA(cudaMemcpyAsync(copy_dst, static_cast<char*>(copy_dst) + copy_bytes, copy_bytes,
                                 cudaMemcpyDeviceToDevice));
    });
    if (i >= 5) {
      one_launch.push_back(k1);
      per_layer.push_back(kl);
      copy.push_back(c);
    }
  }
  PrintSteps(sequences, layers, rows, repeats, step_us, compact_us, packed_us, get_pool_us, with_compact);
  std::printf("  kernel, all layers in one launch: %.1f us; one launch per layer: %.1f us; copy of the step's bytes: "
              "%.1f us (one launch / copy = %.2fx; each timed from an L2 cleared by a %zu MB write)\n",
              Median(one_launch), Median(per_layer), Median(copy), Median(one_launch) / Median(copy),
              flush_bytes >> 20);
  cudaFree(flush);
  cudaFree(copy_dst);
  cudaFree(caches);
  cudaFree(idx_dev);
  cudaFree(rows_dev);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string server;
  int64_t rows = 262144;
  int repeats = 20;
  bool decode_step = false, with_compact = true, shm = false, spin = false;
  int sequences = 256, layers = 61, context = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--decode_step") {
      decode_step = true;
      continue;
    }
    if (a == "--spin") {  // the decode step's caller spins for each answer
      spin = true;
      continue;
    }
    if (a == "--shm") {  // the decode step's rows in host shared memory (no GPU)
      shm = true;
      continue;
    }
    if (a == "--basic_only") {  // a server without SEQUENCE_VIEW_COMPACT
      with_compact = false;
      continue;
    }
    if (i + 1 >= argc) break;
    if (a == "--server") server = argv[++i];
    else if (a == "--rows") rows = std::atoll(argv[++i]);
    else if (a == "--repeats") repeats = std::max(5, std::atoi(argv[++i]));
    else if (a == "--sequences") sequences = std::max(1, std::atoi(argv[++i]));
    else if (a == "--layers") layers = std::max(1, std::atoi(argv[++i]));
    else if (a == "--context") context = std::max(0, std::atoi(argv[++i]));
    else ++i;
  }
  if (server.empty() || rows < 1) {
    std::fprintf(stderr, "usage: %s --server ADDR [--rows N] [--repeats N] | --decode_step [--sequences S] [--layers L] [--basic_only]\n", argv[0]);
    return 2;
  }
  if (decode_step && !server.empty()) {
    auto args = grpc::ChannelArguments();
    args.SetMaxReceiveMessageSize(-1);
    auto stub = mlakv::v1::KvCache::NewStub(grpc::CreateCustomChannel(server, grpc::InsecureChannelCredentials(), args));
    if (static_cast<int64_t>(context) > static_cast<int64_t>(sequences) * layers) {
      std::fprintf(stderr, "--context %d: at most --sequences x --layers (%lld) rows are in the region\n", context,
                   static_cast<long long>(sequences) * layers);
      return 2;
    }
    return RunDecodeStep(*stub, sequences, layers, repeats, context, with_compact, shm, spin);
  }
  // Rows: ckv [rows, 512] then kpe [rows, 64], bf16, random and never zero.
  const size_t ckv_bytes = static_cast<size_t>(rows) * 512 * 2, kpe_bytes = static_cast<size_t>(rows) * 64 * 2;
  const std::vector<uint16_t> host = RandomBf16((ckv_bytes + kpe_bytes) / 2, 7);
  CHECK_CUDA(cudaSetDevice(0));
  void* rows_dev = nullptr;
  CHECK_CUDA(cudaMalloc(&rows_dev, ckv_bytes + kpe_bytes));
  CHECK_CUDA(cudaMemcpy(rows_dev, host.data(), ckv_bytes + kpe_bytes, cudaMemcpyHostToDevice));
  auto channel_args = grpc::ChannelArguments();
  channel_args.SetMaxReceiveMessageSize(-1);
  auto stub = mlakv::v1::KvCache::NewStub(
      grpc::CreateCustomChannel(server, grpc::InsecureChannelCredentials(), channel_args));
  if (!RegisterRegion(*stub, "ipc-bench", rows_dev, ckv_bytes + kpe_bytes)) return 1;
  // The rows of one layer named by reference (the same for both RPCs).
  const auto fill_layer = [&](mlakv::v1::LayerRows* layer) {
    layer->set_layer(0);
    layer->set_ckv_scale(0.02f);
    layer->set_kpe_scale(0.05f);
    layer->mutable_ckv_ref()->set_region("ipc-bench");
    layer->mutable_ckv_ref()->set_offset(0);
    layer->mutable_ckv_ref()->set_row_stride_bytes(1024);
    layer->mutable_kpe_ref()->set_region("ipc-bench");
    layer->mutable_kpe_ref()->set_offset(ckv_bytes);
    layer->mutable_kpe_ref()->set_row_stride_bytes(128);
  };
  const auto free_sequence = [&] {
    mlakv::v1::FreeSequenceRequest free_req;
    free_req.set_sequence("ipc-bench");
    mlakv::v1::FreeSequenceResponse free_resp;
    grpc::ClientContext free_ctx;
    stub->FreeSequence(&free_ctx, free_req, &free_resp);
  };
  // One timed call of each kind per iteration, fresh positions each time (the
  // sequence is freed, untimed, between calls).
  std::vector<double> stream_us, batch_us, lengths_us, get_pool_us;
  for (int i = 0; i < repeats + 3; ++i) {
    {  // Append: a client stream of one message
      mlakv::v1::AppendRequest req;
      req.set_sequence("ipc-bench");
      req.set_row_count(static_cast<uint32_t>(rows));
      req.set_dtype(mlakv::v1::ROW_DTYPE_BFLOAT16);
      fill_layer(req.add_layers());
      const auto t0 = std::chrono::steady_clock::now();
      mlakv::v1::AppendResponse resp;
      grpc::ClientContext ctx;
      ctx.set_initial_metadata_corked(true);
      auto writer = stub->Append(&ctx, &resp);
      writer->Write(req, grpc::WriteOptions().set_last_message());
      const grpc::Status s = writer->Finish();
      const auto t1 = std::chrono::steady_clock::now();
      if (!s.ok()) {
        std::fprintf(stderr, "Append: %d: %s\n", static_cast<int>(s.error_code()), s.error_message().c_str());
        return 1;
      }
      if (i >= 3) stream_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      free_sequence();
    }
    for (const bool lengths_view : {false, true}) {  // AppendBatch: one unary call, view FULL then LENGTHS
      mlakv::v1::AppendBatchRequest req;
      req.set_dtype(mlakv::v1::ROW_DTYPE_BFLOAT16);
      if (lengths_view) req.set_view(mlakv::v1::SEQUENCE_VIEW_LENGTHS);
      mlakv::v1::SequenceRows* seq = req.add_sequences();
      seq->set_sequence("ipc-bench");
      seq->set_row_count(static_cast<uint32_t>(rows));
      fill_layer(seq->add_layers());
      const auto t0 = std::chrono::steady_clock::now();
      mlakv::v1::AppendBatchResponse resp;
      grpc::ClientContext ctx;
      const grpc::Status s = stub->AppendBatch(&ctx, req, &resp);
      const auto t1 = std::chrono::steady_clock::now();
      if (!s.ok()) {
        std::fprintf(stderr, "AppendBatch: %d: %s\n", static_cast<int>(s.error_code()), s.error_message().c_str());
        return 1;
      }
      if (i >= 3) (lengths_view ? lengths_us : batch_us).push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      free_sequence();
    }
    {  // the RPC floor: a unary call that touches no rows
      mlakv::v1::GetPoolRequest req;
      mlakv::v1::Pool resp;
      grpc::ClientContext ctx;
      const auto t0 = std::chrono::steady_clock::now();
      stub->GetPool(&ctx, req, &resp);
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= 3) get_pool_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
  }

  // The kernel alone on the same device rows, page size 64, in this process.
  const int page_size = 64;
  const int pages = static_cast<int>((rows + page_size - 1) / page_size);
  std::vector<int32_t> idx(2 * rows + pages + 2);
  std::fill(idx.begin(), idx.begin() + rows, 0);                      // batch indices
  std::iota(idx.begin() + rows, idx.begin() + 2 * rows, 0);           // positions
  std::iota(idx.begin() + 2 * rows, idx.begin() + 2 * rows + pages, 0);  // kv_indices
  idx[2 * rows + pages] = 0;
  idx[2 * rows + pages + 1] = pages;
  int32_t* idx_dev = nullptr;
  uint8_t* cache = nullptr;
  const size_t entries = static_cast<size_t>(pages) * page_size;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&idx_dev), idx.size() * 4));
  CHECK_CUDA(cudaMemcpy(idx_dev, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&cache), entries * 352));
  mlakv::QuantizeAppendParams p;
  p.append_ckv = rows_dev;
  p.append_kpe = static_cast<char*>(rows_dev) + ckv_bytes;
  p.dtype = mlakv::DType::kBFloat16;
  p.batch_indices = idx_dev;
  p.positions = idx_dev + rows;
  p.num_rows = rows;
  p.ckv_cache = cache;
  p.ckv_sf_cache = cache + entries * 256;
  p.kpe_cache = cache + entries * 288;
  p.num_pages = pages;
  p.page_size = page_size;
  p.kv_indices = idx_dev + 2 * rows;
  p.kv_indptr = idx_dev + 2 * rows + pages;
  p.batch_size = 1;
  p.num_kv_indices = pages;
  p.ckv_scale = 0.02f;
  p.kpe_scale = 0.05f;
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  std::vector<double> kernel_us;
  for (int i = 0; i < repeats + 3; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    if (!mlakv::QuantizeAppend(p, nullptr).ok()) return 1;
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    if (i >= 3) kernel_us.push_back(ms * 1000.0);
  }
  const double kernel = Median(kernel_us);
  std::printf("ipc append of %lld bf16 rows (one layer), medians of %d: kernel alone %.1f us; GetPool (RPC floor) "
              "%.1f us\n",
              static_cast<long long>(rows), repeats, kernel, Median(get_pool_us));
  for (const auto& [name, v] : {std::pair<const char*, const std::vector<double>*>{"Append", &stream_us},
                                {"AppendBatch", &batch_us}, {"AppendBatch, view LENGTHS", &lengths_us}}) {
    std::printf("  %-26s end to end %.1f us (min %.1f): kernel + %.1f us\n", name, Median(*v),
                *std::min_element(v->begin(), v->end()), Median(*v) - kernel);
  }
  UnregisterRegion(*stub, "ipc-bench");
  cudaFree(cache);
  cudaFree(idx_dev);
  cudaFree(rows_dev);
  return 0;
}
