// What every part of the soak shares: the workload's knobs (from flags) and
// the geometry of the pool under test (from GetPool).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "kernels/nvfp4_format.h"

namespace mlakv::soak {

// Stored bytes of one token in one layer (docs/format.md): ckv_packed |
// ckv_sf | kpe, as size_t for offset arithmetic.
inline constexpr size_t kCkvPackedBytes = format::kCkvPackedBytes;
inline constexpr size_t kCkvSfBytes = format::kCkvSfBytes;
inline constexpr size_t kKpeBytes = format::kKpeBytes;
inline constexpr size_t kEntryBytes = format::kEntryBytes;
// Wire bytes of one row of one layer (fp16 and bf16 alike: two-byte elements).
inline constexpr size_t kWireCkvRowBytes = format::kCkvDim * 2;
inline constexpr size_t kWireKpeRowBytes = format::kKpeDim * 2;
inline constexpr size_t kWireRowBytes = kWireCkvRowBytes + kWireKpeRowBytes;

struct SoakOptions {
  std::string pool;                 // pool named in every request; "" = the server's default pool
  std::string run_prefix;           // every sequence id of this run starts with it
  int clients = 8;                  // client threads, each with its own connections
  absl::Duration duration;          // how long clients start new operations
  uint64_t seed = 1;                // client i draws from seed + i: a run's operations are reproducible
  int sequences_per_client = 6;     // most live sequences a client keeps (its slots)
  uint32_t max_tokens = 384;        // longest layer a client writes or reserves, tokens
  uint32_t max_rows_per_message = 32;
  double fault_fraction = 0.2;      // share of operations that inject a fault
  absl::Duration check_interval = absl::Seconds(5);  // between quiescent checks
  int sample_reads = 8;             // sequences read back byte-exact at each quiescent check
  uint32_t max_message_bytes = 1u << 20;            // the server's max_message_bytes
  absl::Duration idle_timeout = absl::Seconds(1);   // the server's append_idle_timeout_seconds
  absl::Duration call_timeout = absl::Seconds(30);  // deadline of every ordinary call
  // After a stream the client itself ended (cancel, disconnect, deadline),
  // the server may still be rolling it back: the sequence counts as settled
  // once probes find it free and unchanged for this long.
  absl::Duration settle_quiet = absl::Milliseconds(250);
  absl::Duration settle_timeout = absl::Seconds(10);
  int max_violations = 100;         // the run stops early after this many
  // Self-check (0: off): this long into the run client 0 flips one stored
  // byte in one of its models, so the run must report the read-back that
  // no longer matches: proof that the byte checks can fail.
  absl::Duration corrupt_model_after = absl::ZeroDuration();
};

struct LayerScale {
  float ckv = 0;
  float kpe = 0;
};

// The pool under test, as GetPool describes it at the start.
struct PoolGeometry {
  int num_layers = 0;
  uint32_t page_size = 0;
  uint32_t pages_total = 0;
  std::vector<LayerScale> scales;  // per layer; every layer's are fixed (config)
};

}  // namespace mlakv::soak
