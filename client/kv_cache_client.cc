#include "client/kv_cache_client.h"

#include "client/append_stream.h"
#include "client/append_wire.h"
#include "common/status_macros.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace mlakv {
namespace {

constexpr int kCkvDim = 512;
constexpr int kKpeDim = 64;

// ---- transport security (Options::tls_*, token) ----
absl::StatusOr<std::string> ReadPemFile(const char* what, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("client: ", what, " ", path, ": cannot open"));
  std::ostringstream s;
  s << in.rdbuf();
  if (s.str().find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("client: ", what, " ", path, ": not a PEM file"));
  }
  return s.str();
}

// Plaintext, or TLS (with a client certificate for mutual TLS).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeCredentials(const KvCacheClient::Options& o) {
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("client: a TLS client certificate and its key go together");
  }
  if (o.tls_ca_file.empty()) {
    if (!o.tls_cert_file.empty()) return absl::InvalidArgumentError("client: a client certificate needs a TLS CA");
    if (!o.token.empty()) {
      return absl::InvalidArgumentError("client: a bearer token needs TLS (give the server's CA)");
    }
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  MLAKV_ASSIGN_OR_RETURN(std::string ca, ReadPemFile("TLS CA", o.tls_ca_file));
  ssl.pem_root_certs = ca;
  if (!o.tls_cert_file.empty()) {
    MLAKV_ASSIGN_OR_RETURN(std::string cert, ReadPemFile("TLS certificate", o.tls_cert_file));
    MLAKV_ASSIGN_OR_RETURN(std::string key, ReadPemFile("TLS key", o.tls_key_file));
    ssl.pem_cert_chain = cert;
    ssl.pem_private_key = key;
  }
  return grpc::SslCredentials(ssl);
}

// The bearer token, on every call.
void AttachCallMetadata(const KvCacheClient::Options& o, grpc::ClientContext& context) {
  if (!o.token.empty()) context.AddMetadata("authorization", "Bearer " + o.token);
}
// ---- end transport security ----

// One tensor of a layer: its bytes, or its region reference (and the bytes empty).
absl::Status CheckLayerPart(const char* field, uint32_t layer, uint32_t rows, size_t row_bytes, std::string_view bytes,
                            const std::optional<RegionRows>& region) {
  if (!region) {
    if (bytes.size() == size_t{rows} * row_bytes) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("append layer ", layer, ": ", field, " has ", bytes.size(),
                                                   " bytes; rows(", rows, ") x ", row_bytes, " bytes per row is ",
                                                   size_t{rows} * row_bytes));
  }
  if (!bytes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("append layer ", layer, ": ", field, " has both ", bytes.size(),
                                                   " bytes and a region reference; give one"));
  }
  if (region->region.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("append layer ", layer, ": ", field, " region name is empty"));
  }
  const uint64_t stride = region->row_stride_bytes;
  if (stride != 0 && (stride < row_bytes || stride % 2 != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("append layer ", layer, ": ", field, " region '", region->region,
                                                   "' row stride ", stride, " bytes must be 0 (packed) or an even ",
                                                   "number of at least the ", row_bytes, " bytes of a row"));
  }
  return absl::OkStatus();
}

absl::Status CheckAppendShape(const AppendRows& append) {
  const int element = RowDTypeBytes(append.dtype);
  if (element == 0) return absl::InvalidArgumentError("append: dtype is unspecified (want float16 or bfloat16)");
  if (append.sequence.empty()) return absl::InvalidArgumentError("append: sequence id is empty");
  if (append.layers.empty()) return absl::InvalidArgumentError("append: no layers given");
  for (const LayerBytes& layer : append.layers) {
    if (absl::Status s =
            CheckLayerPart("ckv", layer.layer, append.rows, size_t{kCkvDim} * element, layer.ckv, layer.ckv_region);
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            CheckLayerPart("kpe", layer.layer, append.rows, size_t{kKpeDim} * element, layer.kpe, layer.kpe_region);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// Row bytes that travel on the wire per row of `append` (rows from regions do not).
size_t WireRowBytes(const AppendRows& append) {
  const size_t element = RowDTypeBytes(append.dtype);
  size_t bytes = 0;
  for (const LayerBytes& layer : append.layers) {
    if (!layer.ckv_region) bytes += kCkvDim * element;
    if (!layer.kpe_region) bytes += kKpeDim * element;
  }
  return bytes;
}

// Rows [first, first + count) of a region reference.
void SetRegionRef(const RegionRows& region, uint32_t first, size_t row_bytes, v1::RegionRef* ref) {
  const uint64_t stride = region.row_stride_bytes == 0 ? row_bytes : region.row_stride_bytes;
  ref->set_region(region.region);
  ref->set_offset(region.offset + uint64_t{first} * stride);
  ref->set_row_stride_bytes(region.row_stride_bytes);
}

// Message `index` of the stream without its rows: rows [first, first + count)
// of every layer, whose bytes (views into the caller's buffers) go to `rows`
// (client/append_wire.h puts them in when it serializes).
v1::AppendRequest AppendHead(const AppendRows& append, uint32_t first, uint32_t count, bool is_first,
                             std::vector<LayerRowBytes>* rows) {
  const size_t element = RowDTypeBytes(append.dtype);
  v1::AppendRequest message;
  message.set_pool(append.pool);
  message.set_sequence(append.sequence);
  message.set_start(append.start + first);
  message.set_row_count(count);
  message.set_dtype(append.dtype);
  if (is_first) {
    message.set_reserve_tokens(append.reserve_tokens);
    if (append.expect_length) message.set_expect_length(*append.expect_length);
    message.set_view(append.view);
    if (append.expect_generation) message.set_expect_generation(*append.expect_generation);
    for (const std::string& hash : append.block_hashes) message.add_block_hashes(hash);
    message.set_block_hashes_first_page(append.block_hashes_first_page);
    message.set_pin(append.pin);
  }
  rows->clear();
  for (const LayerBytes& layer : append.layers) {
    v1::LayerRows* entry = message.add_layers();
    LayerRowBytes& bytes = rows->emplace_back();
    entry->set_layer(layer.layer);
    if (layer.ckv_region) {
      SetRegionRef(*layer.ckv_region, first, kCkvDim * element, entry->mutable_ckv_ref());
    } else {
      bytes.ckv = layer.ckv.substr(size_t{first} * kCkvDim * element, size_t{count} * kCkvDim * element);
    }
    if (layer.kpe_region) {
      SetRegionRef(*layer.kpe_region, first, kKpeDim * element, entry->mutable_kpe_ref());
    } else {
      bytes.kpe = layer.kpe.substr(size_t{first} * kKpeDim * element, size_t{count} * kKpeDim * element);
    }
    if (layer.ckv_scale) entry->set_ckv_scale(*layer.ckv_scale);
    if (layer.kpe_scale) entry->set_kpe_scale(*layer.kpe_scale);
  }
  return message;
}

// A lease duration as the wire's whole milliseconds (rounded up; zero stays
// zero: the pool's default).
absl::StatusOr<uint32_t> DurationMs(const char* what, absl::Duration duration) {
  if (duration < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": lease duration ", absl::FormatDuration(duration),
                                                   " is negative (zero means the pool's default)"));
  }
  const absl::Duration ms = absl::Ceil(duration, absl::Milliseconds(1));
  if (ms > absl::Milliseconds(std::numeric_limits<uint32_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": lease duration ", absl::FormatDuration(duration),
                                                   " does not fit the wire's uint32 milliseconds"));
  }
  return static_cast<uint32_t>(absl::ToInt64Milliseconds(ms));
}

absl::Status SetLeaseTerms(const char* what, const LeaseTerms& terms, v1::LeaseOptions* out) {
  MLAKV_ASSIGN_OR_RETURN(uint32_t ms, DurationMs(what, terms.duration));
  out->set_holder(terms.holder);
  out->set_duration_ms(ms);
  return absl::OkStatus();
}

}  // namespace

int RowDTypeBytes(v1::RowDType dtype) {
  return dtype == v1::ROW_DTYPE_FLOAT16 || dtype == v1::ROW_DTYPE_BFLOAT16 ? 2 : 0;
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // grpc::StatusCode and absl::StatusCode share their numbering (both are the
  // canonical google.rpc.Code values).
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<std::unique_ptr<KvCacheClient>> KvCacheClient::Create(Options options) {
  if (options.target.empty()) return absl::InvalidArgumentError("client: target (host:port) is empty");
  if (options.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("client: timeout must be positive");
  if (options.append_message_bytes == 0) {
    return absl::InvalidArgumentError("client: append_message_bytes must be positive");
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);  // ReadSequence chunks are ~4 MB plus framing
  args.SetMaxSendMessageSize(-1);
  // A channel of its own connection: N clients are N TCP connections.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  if (options.max_reconnect_backoff > absl::ZeroDuration()) {
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(options.max_reconnect_backoff));
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, ms);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, std::min(ms, 1000));
  }
  MLAKV_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials, MakeCredentials(options));
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(options.target, credentials, args);
  if (!channel) return absl::InternalError(absl::StrCat("client: cannot create a channel to ", options.target));
  return std::unique_ptr<KvCacheClient>(new KvCacheClient(std::move(options), std::move(channel)));
}

KvCacheClient::KvCacheClient(Options options, std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::KvCache::NewStub(channel_)),
      append_method_name_(absl::StrCat("/", v1::KvCache::service_full_name(), "/Append")),
      append_method_(std::make_unique<grpc::internal::RpcMethod>(
          append_method_name_.c_str(), grpc::internal::RpcMethod::CLIENT_STREAMING, channel_)),
      append_batch_method_name_(absl::StrCat("/", v1::KvCache::service_full_name(), "/AppendBatch")),
      append_batch_method_(std::make_unique<grpc::internal::RpcMethod>(
          append_batch_method_name_.c_str(), grpc::internal::RpcMethod::NORMAL_RPC, channel_)) {}

void KvCacheClient::PrepareContext(grpc::ClientContext& context, absl::Duration timeout) const {
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  AttachCallMetadata(options_, context);
}

void KvCacheClient::ConnectNow(absl::Duration timeout) {
  grpc::experimental::ChannelResetConnectionBackoff(channel_.get());
  const auto deadline = absl::ToChronoTime(absl::Now() + timeout);
  grpc_connectivity_state state = channel_->GetState(/*try_to_connect=*/true);
  bool attempted = false;
  while (state != GRPC_CHANNEL_READY) {
    if (state == GRPC_CHANNEL_CONNECTING) attempted = true;
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE && attempted) return;  // the attempt failed
    if (!channel_->WaitForStateChange(state, deadline)) return;        // timed out
    state = channel_->GetState(/*try_to_connect=*/true);
  }
}

absl::Status KvCacheClient::CheckHealth(absl::Duration timeout) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  PrepareContext(context, timeout);
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  MLAKV_RETURN_IF_ERROR(FromGrpcStatus(health->Check(&context, request, &response)));
  if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat("health: server answers ",
                                               grpc::health::v1::HealthCheckResponse::ServingStatus_Name(
                                                   response.status())));
  }
  return absl::OkStatus();
}

template <typename Request, typename Response>
absl::StatusOr<Response> KvCacheClient::Call(UnaryMethod<Request, Response> method, const Request& request,
                                             absl::Duration timeout) {
  grpc::ClientContext context;
  PrepareContext(context, timeout);
  Response response;
  MLAKV_RETURN_IF_ERROR(FromGrpcStatus((stub_.get()->*method)(&context, request, &response)));
  return response;
}

template <typename Request, typename Response>
absl::StatusOr<Response> KvCacheClient::Call(UnaryMethod<Request, Response> method, const Request& request) {
  return Call(method, request, options_.timeout);
}

absl::StatusOr<std::vector<v1::Pool>> KvCacheClient::ListPools() { return ListPools(options_.timeout); }

absl::StatusOr<std::vector<v1::Pool>> KvCacheClient::ListPools(absl::Duration timeout) {
  MLAKV_ASSIGN_OR_RETURN(v1::ListPoolsResponse response,
                         Call(&v1::KvCache::Stub::ListPools, v1::ListPoolsRequest(), timeout));
  return std::vector<v1::Pool>(response.pools().begin(), response.pools().end());
}

absl::StatusOr<v1::Pool> KvCacheClient::GetPool(const std::string& pool) {
  v1::GetPoolRequest request;
  request.set_pool(pool);
  return Call(&v1::KvCache::Stub::GetPool, request);
}

absl::StatusOr<v1::Sequence> KvCacheClient::GetSequence(const std::string& pool, const std::string& sequence) {
  v1::GetSequenceRequest request;
  request.set_pool(pool);
  request.set_sequence(sequence);
  return Call(&v1::KvCache::Stub::GetSequence, request);
}

absl::StatusOr<v1::Sequence> KvCacheClient::GetSequence(const std::string& pool, const std::string& sequence,
                                                        const GetSequenceOptions& options) {
  v1::GetSequenceRequest request;
  request.set_pool(pool);
  request.set_sequence(sequence);
  if (options.expect_generation) request.set_expect_generation(*options.expect_generation);
  if (options.lease) MLAKV_RETURN_IF_ERROR(SetLeaseTerms("get sequence", *options.lease, request.mutable_lease()));
  return Call(&v1::KvCache::Stub::GetSequence, request);
}

absl::StatusOr<std::vector<v1::SequenceSummary>> KvCacheClient::ListSequences(const std::string& pool) {
  std::vector<v1::SequenceSummary> all;
  v1::ListSequencesRequest request;
  request.set_pool(pool);
  request.set_page_size(1000);
  do {
    MLAKV_ASSIGN_OR_RETURN(v1::ListSequencesResponse response, Call(&v1::KvCache::Stub::ListSequences, request));
    all.insert(all.end(), response.sequences().begin(), response.sequences().end());
    if (!response.next_page_token().empty() && response.next_page_token() == request.page_token()) {
      return absl::InternalError("list sequences: server returned the same page token twice");
    }
    request.set_page_token(response.next_page_token());
  } while (!request.page_token().empty());
  return all;
}

absl::StatusOr<v1::Page> KvCacheClient::GetPage(const std::string& pool, uint32_t page) {
  v1::GetPageRequest request;
  request.set_pool(pool);
  request.set_page(page);
  return Call(&v1::KvCache::Stub::GetPage, request);
}

absl::StatusOr<uint32_t> KvCacheClient::Free(const std::string& pool, const std::string& sequence) {
  v1::FreeSequenceRequest request;
  request.set_pool(pool);
  request.set_sequence(sequence);
  MLAKV_ASSIGN_OR_RETURN(v1::FreeSequenceResponse response, Call(&v1::KvCache::Stub::FreeSequence, request));
  return response.pages_freed();
}

absl::StatusOr<v1::FreeSequenceResponse> KvCacheClient::FreeSequence(const std::string& pool,
                                                                     const std::string& sequence,
                                                                     std::optional<uint64_t> expect_generation) {
  v1::FreeSequenceRequest request;
  request.set_pool(pool);
  request.set_sequence(sequence);
  if (expect_generation) request.set_expect_generation(*expect_generation);
  return Call(&v1::KvCache::Stub::FreeSequence, request);
}

absl::StatusOr<v1::Sequence> KvCacheClient::Truncate(const std::string& pool, const std::string& sequence,
                                                     uint32_t length, std::optional<uint64_t> expect_generation) {
  v1::TruncateSequenceRequest request;
  request.set_pool(pool);
  request.set_sequence(sequence);
  request.set_length(length);
  if (expect_generation) request.set_expect_generation(*expect_generation);
  return Call(&v1::KvCache::Stub::TruncateSequence, request);
}

absl::StatusOr<v1::AppendResponse> KvCacheClient::Append(const AppendRows& append) {
  MLAKV_RETURN_IF_ERROR(CheckAppendShape(append));
  // Rows that all come from regions make one message of references.
  const size_t row_bytes = WireRowBytes(append);
  const uint32_t rows_per_message =
      row_bytes == 0 ? std::max<uint32_t>(1, append.rows)
                     : static_cast<uint32_t>(std::max<size_t>(1, options_.append_message_bytes / row_bytes));

  grpc::ClientContext context;
  PrepareContext(context, options_.timeout);
  v1::AppendResponse response;
  // Initial metadata travels with the first message, and the last message
  // carries the half-close: a one-message append is one batch on the wire.
  context.set_initial_metadata_corked(true);
  // Messages go out serialized by client/append_wire.h: the rows copied once,
  // or (rows_owner set) referenced.
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel_.get(), *append_method_, &context,
                                                                    &response));
  // An append of zero rows is still one message: it creates the sequence and
  // may reserve pages.
  const size_t messages = append.rows == 0 ? 1 : (size_t{append.rows} + rows_per_message - 1) / rows_per_message;
  std::vector<LayerRowBytes> rows;
  absl::Status serialized;
  const grpc::Status status = WriteAppendStream<grpc::ByteBuffer>(*writer, messages, [&](size_t i) {
    const uint32_t first = static_cast<uint32_t>(i * rows_per_message);
    const v1::AppendRequest head =
        AppendHead(append, first, std::min(rows_per_message, append.rows - first), i == 0, &rows);
    absl::StatusOr<grpc::ByteBuffer> message = SerializeAppendRequest(head, rows, append.rows_owner);
    if (message.ok()) return *std::move(message);
    if (serialized.ok()) serialized = message.status();
    context.TryCancel();  // the write then fails, and nothing commits
    grpc::Slice empty;
    return grpc::ByteBuffer(&empty, 1);
  });
  MLAKV_RETURN_IF_ERROR(serialized);
  MLAKV_RETURN_IF_ERROR(FromGrpcStatus(status));
  return response;
}

absl::StatusOr<v1::AppendBatchResponse> KvCacheClient::AppendBatch(const v1::AppendBatchRequest& request) {
  return Call(&v1::KvCache::Stub::AppendBatch, request);
}

absl::StatusOr<v1::AppendBatchResponse> KvCacheClient::AppendBatch(
    std::shared_ptr<const v1::AppendBatchRequest> request) {
  if (request == nullptr) return absl::InternalError("AppendBatch: no request (a caller's bug)");
  const grpc::ByteBuffer message = SerializeReferencingBytes(*request, request);
  grpc::ClientContext context;
  PrepareContext(context, options_.timeout);
  v1::AppendBatchResponse response;
  MLAKV_RETURN_IF_ERROR(FromGrpcStatus(grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, v1::AppendBatchResponse>(
      channel_.get(), *append_batch_method_, &context, message, &response)));
  return response;
}

absl::StatusOr<v1::Region> KvCacheClient::RegisterShmRegion(const std::string& name, const std::string& shm_name,
                                                            uint64_t offset, uint64_t byte_size) {
  v1::RegisterShmRegionRequest request;
  request.set_name(name);
  request.set_shm_name(shm_name);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  return Call(&v1::KvCache::Stub::RegisterShmRegion, request);
}

absl::StatusOr<v1::Region> KvCacheClient::RegisterCudaRegion(const std::string& name, std::string_view raw_handle,
                                                             int32_t device_id, uint64_t byte_size,
                                                             std::string_view raw_event_handle) {
  v1::RegisterCudaRegionRequest request;
  request.set_name(name);
  request.set_raw_handle(raw_handle.data(), raw_handle.size());
  request.set_device_id(device_id);
  request.set_byte_size(byte_size);
  request.set_raw_event_handle(raw_event_handle.data(), raw_event_handle.size());
  return Call(&v1::KvCache::Stub::RegisterCudaRegion, request);
}

absl::StatusOr<uint32_t> KvCacheClient::UnregisterRegion(const std::string& name) {
  v1::UnregisterRegionRequest request;
  request.set_name(name);
  MLAKV_ASSIGN_OR_RETURN(v1::UnregisterRegionResponse response, Call(&v1::KvCache::Stub::UnregisterRegion, request));
  return response.appends_in_flight();
}

absl::StatusOr<std::vector<v1::Region>> KvCacheClient::ListRegions() {
  absl::StatusOr<v1::ListRegionsResponse> response =
      Call(&v1::KvCache::Stub::ListRegions, v1::ListRegionsRequest());
  if (!response.ok()) return response.status();
  return std::vector<v1::Region>(response->regions().begin(), response->regions().end());
}

absl::StatusOr<v1::ExportPoolResponse> KvCacheClient::ExportPool(const std::string& pool) {
  v1::ExportPoolRequest request;
  request.set_pool(pool);
  return Call(&v1::KvCache::Stub::ExportPool, request);
}

absl::StatusOr<StoredLayer> KvCacheClient::ReadLayer(const std::string& pool, const std::string& sequence,
                                                     uint32_t layer, uint32_t start, uint32_t count) {
  return ReadLayer(pool, sequence, layer, ReadLayerOptions{.start = start, .count = count});
}

absl::StatusOr<StoredLayer> KvCacheClient::ReadLayer(const std::string& pool, const std::string& sequence,
                                                     uint32_t layer, const ReadLayerOptions& options) {
  const uint32_t start = options.start;
  grpc::ClientContext context;
  PrepareContext(context, options_.timeout);
  v1::ReadSequenceRequest request;
  request.set_pool(pool);
  request.set_sequence(sequence);
  request.add_layers(layer);
  request.set_start(start);
  request.set_count(options.count);
  request.set_format(v1::READ_FORMAT_RAW);
  if (options.expect_generation) request.set_expect_generation(*options.expect_generation);
  request.set_lease_id(options.lease_id);
  std::unique_ptr<grpc::ClientReader<v1::ReadSequenceResponse>> reader = stub_->ReadSequence(&context, request);

  StoredLayer stored;
  stored.layer = layer;
  stored.start = start;
  v1::ReadSequenceResponse chunk;
  absl::Status problem;
  while (reader->Read(&chunk)) {
    if (!problem.ok()) continue;  // drain, then report the first problem
    const size_t n = chunk.count();
    if (chunk.layer() != layer || chunk.start() != start + stored.count || chunk.ckv_packed().size() != n * 256 ||
        chunk.ckv_sf().size() != n * 32 || chunk.kpe().size() != n * 64) {
      problem = absl::InternalError(absl::StrCat(
          "read sequence: chunk (layer ", chunk.layer(), ", start ", chunk.start(), ", count ", n, ", bytes ",
          chunk.ckv_packed().size(), "/", chunk.ckv_sf().size(), "/", chunk.kpe().size(), ") does not follow layer ",
          layer, " token ", start + stored.count, " with count x 256/32/64 bytes"));
      continue;
    }
    stored.ckv_packed += chunk.ckv_packed();
    stored.ckv_sf += chunk.ckv_sf();
    stored.kpe += chunk.kpe();
    stored.count += chunk.count();
    stored.ckv_scale = chunk.ckv_scale();
    stored.kpe_scale = chunk.kpe_scale();
  }
  MLAKV_RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
  if (!problem.ok()) return problem;
  if (stored.count == 0) {
    // No chunk carried the scales; the pool still knows them.
    absl::StatusOr<v1::Pool> info = GetPool(pool);
    if (info.ok() && layer < static_cast<uint32_t>(info->layers_size())) {
      stored.ckv_scale = info->layers(layer).ckv_scale();
      stored.kpe_scale = info->layers(layer).kpe_scale();
    }
  }
  return stored;
}

// ---- cache management ----

absl::StatusOr<v1::Lease> KvCacheClient::AcquireLease(const std::string& pool, const std::string& sequence,
                                                      const std::string& holder, absl::Duration duration,
                                                      uint32_t tokens, std::optional<uint64_t> expect_generation) {
  v1::AcquireLeaseRequest request;
  request.set_pool(pool);
  request.set_sequence(sequence);
  if (expect_generation) request.set_expect_generation(*expect_generation);
  MLAKV_RETURN_IF_ERROR(SetLeaseTerms("acquire lease", {.holder = holder, .duration = duration},
                                      request.mutable_lease()));
  request.set_tokens(tokens);
  return Call(&v1::KvCache::Stub::AcquireLease, request);
}

absl::StatusOr<v1::Lease> KvCacheClient::RenewLease(const std::string& pool, uint64_t lease_id,
                                                    absl::Duration duration) {
  v1::RenewLeaseRequest request;
  request.set_pool(pool);
  request.set_lease_id(lease_id);
  MLAKV_ASSIGN_OR_RETURN(uint32_t ms, DurationMs("renew lease", duration));
  request.set_duration_ms(ms);
  return Call(&v1::KvCache::Stub::RenewLease, request);
}

absl::StatusOr<uint32_t> KvCacheClient::ReleaseLease(const std::string& pool, uint64_t lease_id) {
  v1::ReleaseLeaseRequest request;
  request.set_pool(pool);
  request.set_lease_id(lease_id);
  MLAKV_ASSIGN_OR_RETURN(v1::ReleaseLeaseResponse response, Call(&v1::KvCache::Stub::ReleaseLease, request));
  return response.pages_freed();
}

absl::StatusOr<std::vector<v1::Lease>> KvCacheClient::ListLeases(const std::string& pool) {
  std::vector<v1::Lease> all;
  v1::ListLeasesRequest request;
  request.set_pool(pool);
  request.set_page_size(1000);
  do {
    MLAKV_ASSIGN_OR_RETURN(v1::ListLeasesResponse response, Call(&v1::KvCache::Stub::ListLeases, request));
    all.insert(all.end(), response.leases().begin(), response.leases().end());
    if (!response.next_page_token().empty() && response.next_page_token() == request.page_token()) {
      return absl::InternalError("list leases: server returned the same page token twice");
    }
    request.set_page_token(response.next_page_token());
  } while (!request.page_token().empty());
  return all;
}

absl::StatusOr<v1::ForkSequenceResponse> KvCacheClient::ForkSequence(const std::string& pool,
                                                                     const std::string& source,
                                                                     const std::string& target, uint32_t length,
                                                                     bool pin,
                                                                     std::optional<uint64_t> source_generation) {
  // An empty source would make the server read the request as a fork by
  // hash (of no hashes).
  if (source.empty()) return absl::InvalidArgumentError("fork: source sequence id is empty");
  v1::ForkSequenceRequest request;
  request.set_pool(pool);
  request.set_source(source);
  request.set_target(target);
  request.set_length(length);
  request.set_pin(pin);
  if (source_generation) request.set_expect_generation(*source_generation);
  return Call(&v1::KvCache::Stub::ForkSequence, request);
}

absl::StatusOr<v1::ForkSequenceResponse> KvCacheClient::ForkFromHashes(const std::string& pool,
                                                                       const std::vector<std::string>& block_hashes,
                                                                       const std::string& target, bool pin) {
  if (block_hashes.empty()) return absl::InvalidArgumentError("fork: no block hashes given");
  v1::ForkSequenceRequest request;
  request.set_pool(pool);
  request.set_target(target);
  for (const std::string& hash : block_hashes) request.add_block_hashes(hash);
  request.set_pin(pin);
  return Call(&v1::KvCache::Stub::ForkSequence, request);
}

absl::StatusOr<v1::MatchPrefixResponse> KvCacheClient::MatchPrefix(const std::string& pool,
                                                                   const std::vector<std::string>& block_hashes,
                                                                   const std::optional<LeaseTerms>& lease) {
  v1::MatchPrefixRequest request;
  request.set_pool(pool);
  for (const std::string& hash : block_hashes) request.add_block_hashes(hash);
  if (lease) MLAKV_RETURN_IF_ERROR(SetLeaseTerms("match prefix", *lease, request.mutable_lease()));
  return Call(&v1::KvCache::Stub::MatchPrefix, request);
}

}  // namespace mlakv
