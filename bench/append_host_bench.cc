// append_host_bench: the server's host work for one AppendBatch in the
// compact form, without the kernel and without the network.
//
//   append_host_bench [--sequences 256] [--layers 61] [--steps 400]        a decode step
//   append_host_bench --sequences 1 --layers 1 --rows 262144 --view full   a prefill chunk
//   append_host_bench --sequences 1 --written_layers 1 --rows 262144 --view lengths
//                                                   ipc_append_bench's 262k append (one layer of 61)
//   append_host_bench --view compact --steps 400 --passes 80               a decode step, long enough to profile
//   append_host_bench --view compact --layers 4 --context 16384            a decode step at 16k tokens of context
//
// One cpu pool of --layers layers, page size 64, whose backend's Append does
// nothing (NoWriteBackend below): what remains is exactly what the handler
// does on the pool's worker for a compact AppendBatch — the rows resolved and
// cut per sequence (ToCompactBatchRows), every sequence begun, Pool::Stage
// (checks, placement, page tables, the backend's LayerAppend list), the commit,
// the response in SEQUENCE_VIEW_BASIC, and destroying what the call held —
// the part of a decode step that was O(sequences x layers) on the host. Then,
// apart, what the wire adds: the same step's request by reference and its
// response, serialized and parsed once each. Each step appends one token to each of
// --sequences sequences in every layer (expect_length, as a decode worker
// sends it), so pages are allocated every 64 steps as in a real decode.
// With --context N, every sequence first holds N tokens (written untimed, in
// one append per sequence, before each pass), so each step's sequences have
// the page tables of an N-token context. The cpu pool's caches are allocated
// for it (tcmalloc zeroes them at once): 256 sequences at 16k tokens need
// ~6 GB with --layers 4, ~90 GB with 61 -- the page table, what --context
// measures, is one for all layers.
// With --rows N > 1, each step instead writes N rows to fresh sequences
// (freed, untimed, after the step), as ipc_append_bench's one-layer appends do.
// The rows are one bytes field per layer (the same host memory every step).
//
// Prints the median, p90 and p99 of the step and of its phases, and the same
// for a reference in the same run: a loop that only touches every
// (sequence, layer) pair's 8-byte slot once (the least any per-pair pass can
// cost), so the ratio says how far the pool's work is from one pass.
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "bench/bench_stats.h"
#include "mlakv/v1/kv_cache.pb.h"
#include "server/backend/forwarding_backend.h"
#include "server/core/atomic_append.h"
#include "server/core/kv_events.h"
#include "server/core/pool.h"
#include "server/cq/message_recycler.h"
#include "server/regions/region_registry.h"
#include "server/rpc/append_wire.h"
#include "server/rpc/proto_convert.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(int, sequences, 256, "sequences per step");
ABSL_FLAG(int, layers, 61, "layers of the pool (all written every step, unless --written_layers)");
ABSL_FLAG(int, written_layers, 0, "layers each step writes, from layer 0 (0: every layer; 1 with --rows 262144: "
          "ipc_append_bench's one-layer append into a 61-layer pool)");
ABSL_FLAG(int, steps, 400, "steps (calls) timed");
ABSL_FLAG(int, rows, 1, "rows per sequence per step (> 1: fresh sequences every step)");
ABSL_FLAG(std::string, view, "basic", "the response's view: basic, compact, lengths, packed or full");
ABSL_FLAG(int, id_bytes, 14,
          "bytes of each sequence id (14: 'request-1000NN'; vLLM's request ids are ~40, past std::string's inline 15)");
ABSL_FLAG(int, context, 0, "tokens every sequence holds before the first timed step (decode steps only)");
ABSL_FLAG(int, passes, 1,
          "times the --steps steps are run, every sequence freed (untimed) between passes: more samples (and a "
          "longer profile) from the same pool");

namespace mlakv::bench {
namespace {

namespace v1 = ::mlakv::v1;
using server::AtomicAppend;
using server::CacheBackend;
using server::Pool;
using server::SequenceRowsIn;
using server::SequenceSnapshot;
// Forwards everything but Append, which it accepts without writing: the
// bench measures the host work around the kernel, not the CPU quantizer.
class NoWriteBackend final : public server::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status Append(std::span<const server::LayerAppend> layers) override {
    for (const server::LayerAppend& la : layers) {
      appended_segments += la.segments.size();
      if (la.segments.data() != layers.front().segments.data()) ++separate_placements;
    }
    return absl::OkStatus();
  }
  uint64_t appended_segments = 0;
  uint64_t separate_placements = 0;  // layers whose segments are not the first layer's span
};

double Us(Clock::time_point a, Clock::time_point b) { return Micros(b - a); }
[[noreturn]] void Fail(const char* what, const absl::Status& s) { Die("append_host_bench", absl::StrCat(what, ": ", s.message())); }

int Run() {
  const int sequences = absl::GetFlag(FLAGS_sequences), layers = absl::GetFlag(FLAGS_layers);
  const int written = absl::GetFlag(FLAGS_written_layers) > 0 ? std::min(layers, absl::GetFlag(FLAGS_written_layers)) : layers;
  const int steps = absl::GetFlag(FLAGS_steps);
  const int rows_per = absl::GetFlag(FLAGS_rows);
  const bool fresh = rows_per > 1;
  const int context = fresh ? 0 : std::max(0, absl::GetFlag(FLAGS_context));
  const std::string view_flag = absl::GetFlag(FLAGS_view);
  const v1::SequenceView view = view_flag == "full"      ? v1::SEQUENCE_VIEW_FULL
                                : view_flag == "compact" ? v1::SEQUENCE_VIEW_COMPACT
                                : view_flag == "lengths" ? v1::SEQUENCE_VIEW_LENGTHS
                                : view_flag == "packed"  ? v1::SEQUENCE_VIEW_PACKED
                                : view_flag == "basic"   ? v1::SEQUENCE_VIEW_BASIC
                                                         : v1::SEQUENCE_VIEW_UNSPECIFIED;
  if (view == v1::SEQUENCE_VIEW_UNSPECIFIED) Die("append_host_bench", "--view must be basic, compact, lengths, packed or full");
  const std::string server_id = "mlakv-0.mlakv.serving";  // as the handler's (a pod's name)
  constexpr int kPageSize = 64;
  Pool::Options opts;
  opts.name = "bench";
  opts.num_layers = layers;
  opts.page_size = kPageSize;
  opts.num_pages = fresh ? sequences * (rows_per / kPageSize + 2) : sequences * ((context + steps + 21) / kPageSize + 2);
  opts.layer_scales.assign(layers, Pool::Options::Scales{1.0f, 1.0f});
  server::EventLog events({});  // as in mlakv-server, which always keeps one (KV events)
  opts.events = &events;
  NoWriteBackend* backend = nullptr;
  opts.wrap_backend = [&](std::unique_ptr<CacheBackend> inner) {
    auto b = std::make_unique<NoWriteBackend>(std::move(inner));
    backend = b.get();
    return b;
  };
  absl::StatusOr<std::unique_ptr<Pool>> pool = Pool::Create(opts);
  if (!pool.ok()) Fail("pool", pool.status());
  server::RegionRegistry regions({});

  // The request: one bytes field per layer holding every sequence's row.
  const size_t batch_rows = static_cast<size_t>(sequences) * rows_per;
  const std::string ckv(batch_rows * 512 * 2, '\x3c');
  const std::string kpe(batch_rows * 64 * 2, '\x3c');
  // As the server's AppendBatch receives it, the plain way (rows in the
  // message's bytes fields).
  server::ReceivedAppendBatch received;
  v1::AppendBatchRequest& req = received.message;
  req.set_pool("bench");
  req.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  req.set_view(view);
  for (int s = 0; s < sequences; ++s) {
    v1::SequenceRows* sr = req.add_sequences();
    std::string id = absl::StrCat("request-", 100000 + s);
    id.insert(8, static_cast<size_t>(std::max(0, absl::GetFlag(FLAGS_id_bytes) - static_cast<int>(id.size()))), '0');
    sr->set_sequence(std::move(id));
    sr->set_row_count(rows_per);
  }
  for (int l = 0; l < written; ++l) {
    v1::LayerRows* lr = req.add_batch_layers();
    lr->set_layer(l);
    lr->set_ckv(ckv);
    lr->set_kpe(kpe);
  }

  server::cq::MessageRecycler<server::ReceivedAppendBatch> recycled_requests(1, server::KeepForReuse);
  std::vector<double> total, prepare, stage, commit, respond, release, reference, wire_server, wire_client,
      server_parse, plain_parse, freed;
  size_t request_bytes = 0, response_bytes = 0;
  // The same step as a client sends it by reference (ipc_append_bench
  // --decode_step): each layer one range of a CUDA region.
  v1::AppendBatchRequest by_reference = req;
  for (int l = 0; l < written; ++l) {
    v1::LayerRows* lr = by_reference.mutable_batch_layers(l);
    lr->clear_ckv();
    lr->clear_kpe();
    lr->mutable_ckv_ref()->set_region("ipc-decode");
    lr->mutable_ckv_ref()->set_offset(static_cast<uint64_t>(l) * batch_rows * 1024);
    lr->mutable_kpe_ref()->set_region("ipc-decode");
    lr->mutable_kpe_ref()->set_offset(static_cast<uint64_t>(l) * batch_rows * 128);
  }
  std::vector<uint64_t> slots(static_cast<size_t>(sequences) * written, 0);
  const int passes = std::max(1, absl::GetFlag(FLAGS_passes));
  for (int pass = 0; pass < passes; ++pass) {
    if (pass > 0 && !fresh) {  // every sequence back to empty, untimed
      for (const v1::SequenceRows& s : req.sequences()) {
        if (absl::StatusOr<server::FreeResult> f = (*pool)->FreeSequence(s.sequence()); !f.ok()) Fail("free", f.status());
      }
    }
    if (context > 0) {  // the context, untimed: one append of every layer per sequence
      const std::string context_ckv(static_cast<size_t>(context) * 512 * 2, '\x3c');
      const std::string context_kpe(static_cast<size_t>(context) * 64 * 2, '\x3c');
      SequenceRowsIn rows;
      rows.row_count = static_cast<uint32_t>(context);
      for (int l = 0; l < layers; ++l) rows.layers.push_back(server::LayerRows::FromBytes(l, context_ckv, context_kpe));
      for (const v1::SequenceRows& s : req.sequences()) {
        AtomicAppend append(pool->get());
        const std::string* id = &s.sequence();
        const SequenceRowsIn* r = &rows;
        if (absl::Status st = append.Begin({&id, 1}); !st.ok()) Fail("context begin", st);
        if (absl::Status st = append.Stage({&r, 1}, DType::kBFloat16); !st.ok()) Fail("context stage", st);
        if (absl::StatusOr<std::vector<SequenceSnapshot>> c = append.Commit([] { return absl::OkStatus(); }); !c.ok()) {
          Fail("context commit", c.status());
        }
      }
    }
    for (int step = 0; step < steps + 20; ++step) {  // the first 20 of the first pass warm up
      for (v1::AppendBatchRequest* r : {&req, &by_reference}) {
        for (int s = 0; s < sequences; ++s) {
          v1::SequenceRows* sr = r->mutable_sequences(s);
          sr->set_start(fresh ? 0 : context + step);
          if (context + step > 0 && !fresh) {
            sr->set_expect_length(context + step);
          } else {
            sr->clear_expect_length();
          }
        }
      }
      const Clock::time_point t0 = Clock::now();
      // What the handler holds until it returns (destroyed in "release").
      struct CallState {
        explicit CallState(Pool* p) : append(p) {}
        AtomicAppend append;
        server::RegionHold hold;
        server::CompactBatchRows compact;
      };
      auto call = std::make_unique<CallState>(pool->get());
      AtomicAppend& append = call->append;
      server::CompactBatchRows& compact = call->compact;
      if (absl::Status st = server::ToCompactBatchRows(received, regions, **pool, &call->hold, &compact); !st.ok()) {
        Fail("rows", st);
      }
      const std::vector<SequenceRowsIn>* rows = &compact.sequences;
      std::vector<const std::string*> ids;
      for (const v1::SequenceRows& s : req.sequences()) ids.push_back(&s.sequence());
      if (absl::Status st = append.Begin(ids); !st.ok()) Fail("begin", st);
      std::vector<const SequenceRowsIn*> ptrs;
      for (const SequenceRowsIn& r : *rows) ptrs.push_back(&r);
      const Clock::time_point t1 = Clock::now();
      if (absl::Status st = append.Stage(ptrs, DType::kBFloat16); !st.ok()) Fail("stage", st);
      const Clock::time_point t2 = Clock::now();
      // As the handler: what the response needs from the transactions, read before the commit ends them.
      std::vector<size_t> first_new;
      first_new.reserve(append.size());
      for (size_t i = 0; i < append.size(); ++i) first_new.push_back(append.transaction(i).original_pages());
      const uint32_t pages_allocated = append.pages_allocated();
      absl::StatusOr<std::vector<SequenceSnapshot>> after = append.Commit([] { return absl::OkStatus(); }, server::SnapshotPagesFor(view));
      if (!after.ok()) Fail("commit", after.status());
      const Clock::time_point t3 = Clock::now();
      v1::AppendBatchResponse resp;
      server::AddBatchSequences("bench", *after, first_new, pages_allocated, view, server_id, &resp);
      const Clock::time_point t3b = Clock::now();
      call.reset();
      after = absl::StatusOr<std::vector<SequenceSnapshot>>();
      const Clock::time_point t4 = Clock::now();
      // What the wire adds for the same step by reference: the request and the
      // response serialized and parsed once each (as client and server do),
      // with the request's rows carried as region references, not bytes.
      Clock::time_point w[5], plain[2];
      {
        std::string request_wire, response_wire;
        w[0] = Clock::now();
        by_reference.SerializeToString(&request_wire);  // client
        // The server receives it as slices and parses it leaving any rows
        // there (ReceivedAppendBatch); protobuf's plain parse is timed beside.
        grpc::Slice slice(request_wire.data(), request_wire.size(), grpc::Slice::STATIC_SLICE);
        grpc::ByteBuffer received_wire(&slice, 1);
        w[1] = Clock::now();
        // Into the last step's cleared message, as the server's AppendBatch
        // calls take theirs (cq/message_recycler.h).
        std::unique_ptr<server::ReceivedAppendBatch> parsed = recycled_requests.Take();  // server
        if (!server::ParseAppendBatchMessage(&received_wire, parsed.get())) Die("append_host_bench", "request parse");
        w[2] = Clock::now();
        recycled_requests.Give(std::move(parsed));
        resp.SerializeToString(&response_wire);  // server
        w[3] = Clock::now();
        v1::AppendBatchResponse parsed_resp;  // client
        if (!parsed_resp.ParseFromString(response_wire)) Die("append_host_bench", "response parse");
        w[4] = Clock::now();
        request_bytes = request_wire.size();
        response_bytes = response_wire.size();
        plain[0] = Clock::now();
        v1::AppendBatchRequest plain_parsed;
        if (!plain_parsed.ParseFromString(request_wire)) Die("append_host_bench", "request parse");
        plain[1] = Clock::now();
      }
      // The reference: one pass over every (sequence, layer) pair.
      const Clock::time_point t4c = Clock::now();
      for (size_t i = 0; i < slots.size(); ++i) slots[i] += i ^ static_cast<size_t>(step);
      const Clock::time_point t5 = Clock::now();
      if (fresh) {  // not part of the step: a FreeSequence call of its own
        for (const v1::SequenceRows& s : req.sequences()) {
          if (absl::StatusOr<server::FreeResult> f = (*pool)->FreeSequence(s.sequence()); !f.ok()) Fail("free", f.status());
        }
        if (pass > 0 || step >= 20) freed.push_back(Us(t5, Clock::now()));
      }
      if (pass == 0 && step < 20) continue;
      total.push_back(Us(t0, t4));
      prepare.push_back(Us(t0, t1));
      stage.push_back(Us(t1, t2));
      commit.push_back(Us(t2, t3));
      respond.push_back(Us(t3, t3b));
      release.push_back(Us(t3b, t4));
      reference.push_back(Us(t4c, t5));
      wire_server.push_back(Us(w[1], w[3]));
      server_parse.push_back(Us(w[1], w[2]));
      plain_parse.push_back(Us(plain[0], plain[1]));
      wire_client.push_back(Us(w[0], w[1]) + Us(w[3], w[4]));
    }
  }
  if (absl::Status st = (*pool)->CheckInvariants(); !st.ok()) Fail("invariants", st);
  std::printf("AppendBatch host work: %d sequences x %d rows x %d of %d layers, %d steps x %d passes, view %s (segments handed to the "
              "backend: %llu, layers with a placement of their own: %llu)\n",
              sequences, rows_per, written, layers, steps, passes, absl::GetFlag(FLAGS_view).c_str(), static_cast<unsigned long long>(backend->appended_segments),
              static_cast<unsigned long long>(backend->separate_placements));
  auto line = [](const char* what, std::vector<double> v) {
    const Summary s = Summarize(std::move(v));
    std::printf("  %-32s p50 %9.1f us  p90 %9.1f us  p99 %9.1f us\n", what, s.p50, s.p90, s.p99);
  };
  line("step (prepare..release)", total);
  line("  prepare (rows, begin)", prepare);
  line("  stage", stage);
  line("  commit", commit);
  line("  respond", respond);
  line("  release (the call's state)", release);
  if (!freed.empty()) line("free the sequences (after)", freed);
  line("reference: one pass over pairs", reference);
  std::printf("  wire, by reference: request %zu bytes, response %zu bytes\n", request_bytes, response_bytes);
  line("  server: parse + serialize", wire_server);
  line("    parse (as received, recycled)", server_parse);
  line("    parse (protobuf, plain, fresh)", plain_parse);
  line("  client: serialize + parse", wire_client);
  std::printf("  step / reference p50: %.1fx (slots checksum %llu)\n",
              Summarize(total).p50 / std::max(1e-3, Summarize(reference).p50),
              static_cast<unsigned long long>(slots[slots.size() / 2]));
  return 0;
}

}  // namespace
}  // namespace mlakv::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  spdlog::set_level(spdlog::level::warn);
  // As mlakv-server runs (server/main.cc): no lock-order checks, large
  // blocks kept in the heap.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  return mlakv::bench::Run();
}
