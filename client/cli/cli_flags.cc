#include "client/cli/cli_flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "address (host:port) of the mlakv server");
ABSL_FLAG(std::string, servers, "",
          "a fleet instead of --server: HOST:PORT,HOST:PORT,... ; a command for a sequence goes to the server "
          "rendezvous hashing of its id picks among the healthy ones, pools and seqs ask every server");
ABSL_FLAG(std::string, service, "",
          "a fleet found by DNS instead of --server: dns:///NAME:PORT, every address NAME resolves to (a headless "
          "Kubernetes Service); placement as --servers");
ABSL_FLAG(std::string, server_id, "",
          "with --servers/--service: send the command to the server with this id (its --server_id, as mlakv pools "
          "shows) instead of the one placement picks; commands that name no sequence need it");
ABSL_FLAG(bool, json, false, "print the result as JSON (for scripts) instead of text");
ABSL_FLAG(std::string, pool, "", "pool name; empty means the server's default pool");
ABSL_FLAG(double, timeout_s, 60, "deadline of each call to the server, seconds");
ABSL_FLAG(std::string, sequence, "", "append, export: sequence id");
ABSL_FLAG(int32_t, layer, -1, "append, export: layer index");
ABSL_FLAG(std::string, input, "",
          "quantize, append: safetensors file with ckv [N,512] and kpe [N,64] (BF16 or F16), optionally the F32 "
          "scalars ckv_scale and kpe_scale");
ABSL_FLAG(std::string, output, "", "quantize, export: safetensors file to write (ckv_packed, ckv_sf, kpe)");
ABSL_FLAG(std::optional<double>, ckv_scale, std::nullopt,
          "quantize, append: global ckv decode scale (overrides the file's ckv_scale)");
ABSL_FLAG(std::optional<double>, kpe_scale, std::nullopt,
          "quantize, append: global kpe decode scale (overrides the file's kpe_scale)");
ABSL_FLAG(std::string, dtype, "bf16", "bench, append from regions: row element type, bf16 or f16");
ABSL_FLAG(int64_t, rows, -1, "make-rows: rows to write; append from regions: rows per layer the server reads");
ABSL_FLAG(int64_t, length, -1,
          "truncate: new length of the sequence, tokens; fork: tokens of the source to share (default: all)");

// ---- cache management (leases, forks, prefix matches) ----
ABSL_FLAG(std::optional<uint64_t>, expect_generation, std::nullopt,
          "seq, free, truncate, fork, lease acquire: act only on this incarnation of the sequence (its generation)");
ABSL_FLAG(std::string, holder, "", "lease acquire: who holds the lease (1..256 bytes, e.g. decode-worker-3)");
ABSL_FLAG(std::string, lease_holder, "",
          "seq, match: also take a lease (on the sequence's length; on the matched pages) for this holder");
ABSL_FLAG(uint32_t, duration_ms, 0,
          "lease acquire/renew, seq and match with --lease_holder: lease duration, ms (0: the pool's default)");
ABSL_FLAG(uint32_t, tokens, 0, "lease acquire: tokens to protect from position 0 (0: the sequence's length)");
ABSL_FLAG(bool, pin, false, "fork: create the target pinned (never evicted, never freed by the idle TTL)");
ABSL_FLAG(std::string, hashes, "",
          "fork: instead of SOURCE, fork from this block-hash chain (comma-separated hex, first page first)");
// ---- end cache management ----

// ---- transport security (docs/deploy.md) ----
ABSL_FLAG(std::string, tls_ca, "", "PEM file of the CA that signed the server's certificate; switches to TLS");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate, for servers that require mutual TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "name to verify the server certificate against instead of the --server host");
ABSL_FLAG(std::string, token_file, "",
          "file holding the bearer token the server requires (sent as 'authorization: Bearer ...'; needs --tls_ca)");
// ---- end transport security ----
