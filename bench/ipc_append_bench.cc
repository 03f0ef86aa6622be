// IPC append end to end vs the kernel alone (issue 6's measurement).
//
//   ipc_append_bench --server ADDR [--rows 262144] [--repeats 20]
//
// Acts as a prefill worker on the same GPU as a running
// `mlakv-server --allow_ipc --device cuda:0` (a separate process: a CUDA IPC
// handle cannot be opened by the process that exported it). It cudaMallocs
// --rows bf16 rows (ckv then kpe), registers them as a CUDA region, then
// times RPCs that name the region instead of carrying bytes — an Append
// stream of one message and a unary AppendBatch, client call to response, one
// layer, fresh positions each time (the sequence is freed, untimed, between
// calls) — against the kernel alone on the same rows in this process (CUDA
// events), and a GetPool call as the floor of any RPC. Medians of --repeats.
#include <cuda_runtime_api.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_cuda_check.h"
#include "kernels/quantize_append.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"

namespace {


double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string server;
  int64_t rows = 262144;
  int repeats = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--server") server = argv[i + 1];
    else if (a == "--rows") rows = std::atoll(argv[i + 1]);
    else if (a == "--repeats") repeats = std::max(5, std::atoi(argv[i + 1]));
  }
  if (server.empty() || rows < 1) {
    std::fprintf(stderr, "usage: %s --server ADDR [--rows N] [--repeats N]\n", argv[0]);
    return 2;
  }
  // Rows: ckv [rows, 512] then kpe [rows, 64], bf16, random and never zero.
  const size_t ckv_bytes = static_cast<size_t>(rows) * 512 * 2, kpe_bytes = static_cast<size_t>(rows) * 64 * 2;
  std::vector<uint16_t> host((ckv_bytes + kpe_bytes) / 2);
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (auto& h : host) {
    const float f = g(rng) + 0.01f;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    h = static_cast<uint16_t>(u >> 16);
  }
  CHECK_CUDA(cudaSetDevice(0));
  void* rows_dev = nullptr;
  CHECK_CUDA(cudaMalloc(&rows_dev, ckv_bytes + kpe_bytes));
  CHECK_CUDA(cudaMemcpy(rows_dev, host.data(), ckv_bytes + kpe_bytes, cudaMemcpyHostToDevice));
  cudaIpcMemHandle_t handle;
  CHECK_CUDA(cudaIpcGetMemHandle(&handle, rows_dev));

  auto channel_args = grpc::ChannelArguments();
  channel_args.SetMaxReceiveMessageSize(-1);
  auto stub = mlakv::v1::KvCache::NewStub(
      grpc::CreateCustomChannel(server, grpc::InsecureChannelCredentials(), channel_args));
  {
    mlakv::v1::RegisterCudaRegionRequest req;
    req.set_name("ipc-bench");
    req.set_raw_handle(std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
    req.set_device_id(0);
    req.set_byte_size(ckv_bytes + kpe_bytes);
    mlakv::v1::Region resp;
    grpc::ClientContext ctx;
    const grpc::Status s = stub->RegisterCudaRegion(&ctx, req, &resp);
    if (!s.ok()) {
      std::fprintf(stderr, "RegisterCudaRegion: %s\n", s.error_message().c_str());
      return 1;
    }
  }
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
  std::vector<double> stream_us, batch_us, get_pool_us;
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
    {  // AppendBatch: one unary call
      mlakv::v1::AppendBatchRequest req;
      req.set_dtype(mlakv::v1::ROW_DTYPE_BFLOAT16);
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
      if (i >= 3) batch_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
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
                                {"AppendBatch", &batch_us}}) {
    std::printf("  %-11s end to end %.1f us (min %.1f): kernel + %.1f us\n", name, Median(*v),
                *std::min_element(v->begin(), v->end()), Median(*v) - kernel);
  }
  {
    mlakv::v1::UnregisterRegionRequest req;
    req.set_name("ipc-bench");
    mlakv::v1::UnregisterRegionResponse resp;
    grpc::ClientContext ctx;
    stub->UnregisterRegion(&ctx, req, &resp);
  }
  cudaFree(cache);
  cudaFree(idx_dev);
  cudaFree(rows_dev);
  return 0;
}
