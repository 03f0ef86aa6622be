// KvCacheClient: the C++ client of mlakv.v1.KvCache. It speaks only the proto
// (no kernel or server types), turns every grpc::Status into an absl::Status
// (same code, same message) in one place, and splits large appends into
// messages of a few MB inside one Append stream, so that a prefill of any
// length is one atomic append on the server.
//
// One KvCacheClient owns one channel and, through a channel-local subchannel
// pool, its own TCP connection: N clients are N connections. Methods are
// thread-safe (gRPC stubs are); every call carries the deadline of
// Options::timeout.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"

namespace mlakv {

// Where rows of one tensor lie in a region registered with RegisterShmRegion
// or RegisterCudaRegion (server --allow_ipc): row i starts at
// offset + i x row_stride_bytes of the region; each row's elements are
// contiguous.
struct RegionRows {
  std::string region{};
  uint64_t offset = 0;            // bytes from the region's start to row 0
  uint64_t row_stride_bytes = 0;  // bytes from one row to the next; 0: packed rows
};

// Rows of one layer, as the little-endian fp16/bf16 bytes the wire carries,
// or (ckv_region / kpe_region set) as references into registered regions,
// which the server reads itself: nothing but the reference crosses the wire.
struct LayerBytes {
  uint32_t layer = 0;
  std::string_view ckv{};  // rows x 512 elements; empty when ckv_region is set
  std::string_view kpe{};  // rows x 64 elements; empty when kpe_region is set
  // Scales the rows were calibrated for; unset leaves the layer's own.
  std::optional<float> ckv_scale{};
  std::optional<float> kpe_scale{};
  // Instead of the bytes: where the rows lie in a registered region.
  std::optional<RegionRows> ckv_region = std::nullopt;
  std::optional<RegionRows> kpe_region = std::nullopt;
};

// One atomic append of `rows` rows per layer to one sequence, starting at
// `start`. The byte views must stay valid for the duration of the call, and
// region rows unchanged until it returns.
struct AppendRows {
  // Optional: what keeps the byte views' memory alive. When set, the rows go
  // to gRPC by reference instead of being copied into each message, and
  // gRPC holds a reference to the owner until its transport has written
  // them, which can be after Append returns (a cancelled call's bytes may
  // still sit in the connection's write buffer); the bytes must not change
  // until the owner is released. Unset: each message holds a copy.
  std::shared_ptr<const void> rows_owner{};
  std::string pool{};  // empty: the server's default pool
  std::string sequence{};
  uint32_t start = 0;
  uint32_t rows = 0;
  v1::RowDType dtype = v1::ROW_DTYPE_BFLOAT16;
  std::vector<LayerBytes> layers{};
  uint32_t reserve_tokens = 0;  // allocate pages for this many tokens up front
  // Apply only if every layer written holds exactly this many tokens (else
  // FAILED_PRECONDITION, nothing written): set it to `start` when appending
  // at the end of a sequence, so that retrying an append whose response was
  // lost cannot write its tokens twice (docs/reliability.md "Retries").
  std::optional<uint32_t> expect_length{};
  // What the response's sequence carries (BASIC: no whole page table).
  v1::SequenceView view = v1::SEQUENCE_VIEW_UNSPECIFIED;
  // ---- cache management (docs/server.md "Leases", "Shared pages") ----
  // Apply only to this incarnation of the sequence (Sequence.generation; else
  // FAILED_PRECONDITION, or NOT_FOUND when it does not exist).
  std::optional<uint64_t> expect_generation{};
  // Block hashes of page-table entries block_hashes_first_page + i (opaque,
  // 1..64 bytes each, chained by the caller), for MatchPrefix and forks by
  // hash; a page is indexed once it is complete in every layer. Sent in the
  // stream's first message.
  std::vector<std::string> block_hashes{};
  uint32_t block_hashes_first_page = 0;
  // When the append creates the sequence: never evicted, never freed by the
  // idle TTL (FreeSequence still frees it).
  bool pin = false;
};

// Who holds a lease and for how long (zero: the pool's default, 30 s unless
// configured). Sent as whole milliseconds, rounded up.
struct LeaseTerms {
  std::string holder{};  // 1..256 bytes, e.g. "decode-worker-3"
  absl::Duration duration = absl::ZeroDuration();
};

// GetSequence preconditions and extras.
struct GetSequenceOptions {
  // Answer only for this incarnation (else FAILED_PRECONDITION).
  std::optional<uint64_t> expect_generation{};
  // Also take a lease on the sequence's current length, atomically with the
  // page table returned (Sequence.lease).
  std::optional<LeaseTerms> lease{};
};

// Which tokens of one layer ReadLayer reads, and which incarnation.
struct ReadLayerOptions {
  uint32_t start = 0;  // first token
  uint32_t count = 0;  // tokens; 0: to the layer's length
  std::optional<uint64_t> expect_generation{};
  // Read through this sequence lease: the incarnation it holds, even after it
  // was freed (the sequence id may then be empty).
  uint64_t lease_id = 0;
};

// The stored bytes of one layer of a sequence, in token order.
struct StoredLayer {
  uint32_t layer = 0;
  uint32_t start = 0;      // first token
  uint32_t count = 0;      // tokens
  std::string ckv_packed;  // count x 256 packed E2M1
  std::string ckv_sf;      // count x 32 E4M3 block scales
  std::string kpe;         // count x 64 E4M3
  float ckv_scale = 0;     // the layer's global decode scales
  float kpe_scale = 0;
};

// Element bytes of a row dtype (2 for fp16/bf16; 0 when unspecified).
int RowDTypeBytes(v1::RowDType dtype);

class KvCacheClient {
 public:
  struct Options {
    // host:port of the server (any gRPC target string).
    std::string target = "127.0.0.1:50051";
    // Deadline of each call, from its start (a whole Append stream is one call).
    absl::Duration timeout = absl::Seconds(60);
    // Target payload (row bytes) of one Append message; a message never holds
    // less than one row. Kept under 4 MiB so that a server with gRPC's default
    // 4 MiB receive limit accepts it.
    size_t append_message_bytes = (4u << 20) - (64u << 10);
    // ---- transport security and authentication (docs/deploy.md) ----
    // PEM file of the CA that signed the server's certificate; non-empty
    // switches the channel to TLS.
    std::string tls_ca_file{};
    // PEM client certificate chain and its key, for servers that require
    // mutual TLS (--tls_client_ca). Both or neither; need tls_ca_file.
    std::string tls_cert_file{};
    std::string tls_key_file{};
    // Name to check the server certificate against instead of the target's
    // host (e.g. a pod IP behind a certificate for mlakv.NS.svc).
    std::string tls_server_name{};
    // Bearer token sent as "authorization: Bearer <token>" on every call;
    // needs TLS (a token in plaintext can be read on the way).
    std::string token{};
    // ---- end transport security ----
    // Longest wait between reconnection attempts after a refused or lost
    // connection (zero: gRPC's default, up to 120 s). FleetClient keeps it
    // short so that a server that comes back is found by its next probe.
    absl::Duration max_reconnect_backoff = absl::ZeroDuration();
  };

  static absl::StatusOr<std::unique_ptr<KvCacheClient>> Create(Options options);

  // grpc.health.v1 Check of the whole server: OK when SERVING.
  absl::Status CheckHealth(absl::Duration timeout);
  // Tries to connect now, instead of waiting out the reconnect backoff of a
  // refused connection, and waits (at most `timeout`) until the channel is
  // connected or that attempt failed. FleetClient probes with it.
  void ConnectNow(absl::Duration timeout);

  absl::StatusOr<std::vector<v1::Pool>> ListPools();
  // With its own deadline (probes).
  absl::StatusOr<std::vector<v1::Pool>> ListPools(absl::Duration timeout);
  absl::StatusOr<v1::Pool> GetPool(const std::string& pool);
  absl::StatusOr<v1::Sequence> GetSequence(const std::string& pool, const std::string& sequence);
  // With a generation precondition and/or a lease taken with the answer.
  absl::StatusOr<v1::Sequence> GetSequence(const std::string& pool, const std::string& sequence,
                                           const GetSequenceOptions& options);
  // Every sequence of the pool (follows next_page_token to the end).
  absl::StatusOr<std::vector<v1::SequenceSummary>> ListSequences(const std::string& pool);
  absl::StatusOr<v1::Page> GetPage(const std::string& pool, uint32_t page);
  // Returns the number of pages freed.
  absl::StatusOr<uint32_t> Free(const std::string& pool, const std::string& sequence);
  // The whole answer: pages freed now, and the leases (and their pages) that
  // keep the freed incarnation until they end.
  absl::StatusOr<v1::FreeSequenceResponse> FreeSequence(const std::string& pool, const std::string& sequence,
                                                        std::optional<uint64_t> expect_generation = std::nullopt);
  absl::StatusOr<v1::Sequence> Truncate(const std::string& pool, const std::string& sequence, uint32_t length,
                                        std::optional<uint64_t> expect_generation = std::nullopt);

  // One Append stream carrying `append` in messages of about
  // Options::append_message_bytes (only rows sent as bytes count; an append
  // whose rows all come from regions is one message). Validates byte counts
  // and region strides before sending.
  absl::StatusOr<v1::AppendResponse> Append(const AppendRows& append);
  absl::StatusOr<v1::AppendBatchResponse> AppendBatch(const v1::AppendBatchRequest& request);
  // The same call with the request's rows (its bytes fields) sent from where
  // they are, not copied into the message gRPC sends (client/append_wire.h
  // SerializeReferencingBytes): `request` is held until gRPC's transport has
  // written them, and its bytes fields must not change meanwhile.
  absl::StatusOr<v1::AppendBatchResponse> AppendBatch(std::shared_ptr<const v1::AppendBatchRequest> request);

  // The stored (raw) bytes of tokens [start, start + count) of one layer;
  // count 0 reads to the layer's length.
  absl::StatusOr<StoredLayer> ReadLayer(const std::string& pool, const std::string& sequence, uint32_t layer,
                                        uint32_t start = 0, uint32_t count = 0);
  absl::StatusOr<StoredLayer> ReadLayer(const std::string& pool, const std::string& sequence, uint32_t layer,
                                        const ReadLayerOptions& options);

  // ---- cache management (docs/server.md "Leases", "Eviction", "Shared pages") ----
  // A lease on tokens [0, tokens) (0: the sequence's length) of every layer:
  // until it ends or expires they do not change and their pages stay, even
  // through a FreeSequence.
  absl::StatusOr<v1::Lease> AcquireLease(const std::string& pool, const std::string& sequence,
                                         const std::string& holder, absl::Duration duration = absl::ZeroDuration(),
                                         uint32_t tokens = 0,
                                         std::optional<uint64_t> expect_generation = std::nullopt);
  // Extends a lease to now + duration (zero: the pool's default); NOT_FOUND
  // once it ended or expired.
  absl::StatusOr<v1::Lease> RenewLease(const std::string& pool, uint64_t lease_id,
                                       absl::Duration duration = absl::ZeroDuration());
  // Ends a lease; returns the pages it was the last holder of.
  absl::StatusOr<uint32_t> ReleaseLease(const std::string& pool, uint64_t lease_id);
  // Every lease of the pool, by id (follows next_page_token to the end).
  absl::StatusOr<std::vector<v1::Lease>> ListLeases(const std::string& pool);
  // Creates `target` sharing the first `length` tokens (0: all) of `source`:
  // full pages by reference, a partial last page copied. `pin` creates it
  // pinned; source_generation pins the source's incarnation.
  absl::StatusOr<v1::ForkSequenceResponse> ForkSequence(const std::string& pool, const std::string& source,
                                                        const std::string& target, uint32_t length = 0,
                                                        bool pin = false,
                                                        std::optional<uint64_t> source_generation = std::nullopt);
  // Creates `target` from the leading pages of a block-hash chain the pool
  // holds (no page copied). When none matched, nothing is created and the
  // response has no sequence.
  absl::StatusOr<v1::ForkSequenceResponse> ForkFromHashes(const std::string& pool,
                                                          const std::vector<std::string>& block_hashes,
                                                          const std::string& target, bool pin = false);
  // How many leading pages of the chain the pool holds, and which; with
  // `lease`, also a page lease on them (MatchPrefixResponse.lease).
  absl::StatusOr<v1::MatchPrefixResponse> MatchPrefix(const std::string& pool,
                                                      const std::vector<std::string>& block_hashes,
                                                      const std::optional<LeaseTerms>& lease = std::nullopt);

  // ---- regions (server --allow_ipc, else PERMISSION_DENIED; docs/server.md "Regions") ----
  // A POSIX shared-memory object (shm_open name "/x") from `offset`, `byte_size`
  // bytes (0: to the end of the object).
  absl::StatusOr<v1::Region> RegisterShmRegion(const std::string& name, const std::string& shm_name,
                                               uint64_t offset = 0, uint64_t byte_size = 0);
  // A producer's CUDA allocation: the 64 bytes of its cudaIpcMemHandle_t, the
  // device in the server's numbering, and optionally the 64 bytes of a
  // cudaIpcEventHandle_t the server waits on before reading.
  absl::StatusOr<v1::Region> RegisterCudaRegion(const std::string& name, std::string_view raw_handle,
                                                int32_t device_id, uint64_t byte_size,
                                                std::string_view raw_event_handle = {});
  // Returns the appends in flight that still hold the region.
  absl::StatusOr<uint32_t> UnregisterRegion(const std::string& name);
  absl::StatusOr<std::vector<v1::Region>> ListRegions();
  // CUDA IPC handles of a cuda pool's caches (FAILED_PRECONDITION for a cpu pool).
  absl::StatusOr<v1::ExportPoolResponse> ExportPool(const std::string& pool);

  const Options& options() const { return options_; }
  // The raw stub, for callers that need what the wrapper hides (tests that
  // cancel a stream half-way).
  v1::KvCache::Stub& stub() { return *stub_; }

 private:
  template <typename Request, typename Response>
  using UnaryMethod = grpc::Status (v1::KvCache::Stub::*)(grpc::ClientContext*, const Request&, Response*);

  KvCacheClient(Options options, std::shared_ptr<grpc::Channel> channel);
  void PrepareContext(grpc::ClientContext& context, absl::Duration timeout) const;
  // One unary call with the deadline of Options::timeout.
  template <typename Request, typename Response>
  absl::StatusOr<Response> Call(UnaryMethod<Request, Response> method, const Request& request);
  template <typename Request, typename Response>
  absl::StatusOr<Response> Call(UnaryMethod<Request, Response> method, const Request& request,
                                absl::Duration timeout);

  Options options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvCache::Stub> stub_;
  // Append by hand (ByteBuffer messages, client/append_wire.h): its method.
  std::string append_method_name_;
  std::unique_ptr<grpc::internal::RpcMethod> append_method_;
  // AppendBatch with a ByteBuffer request (rows by reference).
  std::string append_batch_method_name_;
  std::unique_ptr<grpc::internal::RpcMethod> append_batch_method_;
};

// grpc::Status -> absl::Status: the same code and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace mlakv
