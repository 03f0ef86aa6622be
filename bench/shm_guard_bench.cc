// shm_guard_bench: what the SIGBUS guard (server/regions/mapping_fault_guard.h)
// costs on the shared-memory read path, which it claims is nothing.
//
//   shm_guard_bench [--repeats 40] [--e2e_repeats 200] [--threads 1]
//
// (a) In one process, rows of 4 MiB and 64 MiB (bf16, ckv rows then kpe
//     rows, as a producer lays them out) are copied (memcpy into a
//     prefaulted buffer) and quantized (QuantizeAppendHost, --threads, into a
//     page-size-64 cache) from
//       - a POSIX shm object mapped read-only and shared, as ShmRegion maps
//         it, registered with MappingFaultGuard;
//       - the same mapping, not registered (unregistered for the run);
//       - anonymous memory (the system's transparent-huge-page setting);
//       - anonymous memory with MADV_NOHUGEPAGE (4 KiB pages, like the shm
//         mapping: separates the page size from shm itself);
//       - a fresh mapping of the same object, registered, read once: what
//         the first append after RegisterShmRegion reads through (its page
//         table entries are made by the first touch).
//     Each timed run follows two untimed ones from the same memory (caches
//     and TLB warm for that source alike). The first four sources take
//     turns within each repeat in counterbalanced orders (kOrders), so drift
//     of the shared machine reaches all of them; the fresh mapping then runs
//     --repeats times on its own (see RunSize). Medians of --repeats, wall clock and
//     the thread's CPU time.
// (b) End to end through an in-process KvCacheServer (cpu backend,
//     --allow_ipc): one Append stream of one 4 MiB message whose rows are
//     named in a registered shm region, against the same rows carried as
//     bytes (the request built once, outside the timing), and GetPool as
//     the floor of any call. Each call appends at position 0 of a fresh
//     sequence, freed untimed afterwards. p50 / p99 of --e2e_repeats.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <malloc.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "bench/bench_stats.h"
#include "kernels/quantize_append.h"
#include "mlakv/v1/kv_cache.grpc.pb.h"
#include "server/rpc/kv_cache_server.h"
#include "server/regions/mapping_fault_guard.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(int, repeats, 40, "runs per (size, source, operation) in part (a), rounded up to a multiple of 4");
ABSL_FLAG(int, e2e_repeats, 200, "calls per kind in part (b)");
ABSL_FLAG(int, threads, 1, "QuantizeAppendHost threads in part (a)");

namespace mlakv::bench {
namespace {

namespace v1 = ::mlakv::v1;
using server::KvCacheServer;
using server::MappingFaultGuard;

constexpr uint64_t kCkvRowBytes = 512 * 2, kKpeRowBytes = 64 * 2, kRowBytes = kCkvRowBytes + kKpeRowBytes;
constexpr int kPageSize = 64;

[[noreturn]] void Die(const std::string& what) { bench::Die("shm_guard_bench", what); }

// Rows of `bytes` / 1152 bf16 rows: ckv [rows, 512] then kpe [rows, 64],
// varied finite values (the quantizer's cost does not depend on them much).
std::vector<uint8_t> RandomRows(int64_t rows) {
  std::vector<uint16_t> v(static_cast<size_t>(rows) * (kRowBytes / 2));
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  for (uint16_t& h : v) {
    const float f = normal(gen);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    h = static_cast<uint16_t>(u >> 16);
  }
  std::vector<uint8_t> out(v.size() * 2);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// A POSIX shared-memory object holding `rows`, unlinked when destroyed.
class ShmObject {
 public:
  explicit ShmObject(const std::vector<uint8_t>& rows, const std::string& tag)
      : name_(absl::StrFormat("/mlakv-guard-bench-%d-%s", getpid(), tag)), bytes_(rows.size()) {
    const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) Die(absl::StrFormat("shm_open %s: %s", name_, std::strerror(errno)));
    if (ftruncate(fd, static_cast<off_t>(bytes_)) != 0) Die("ftruncate failed");
    void* w = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (w == MAP_FAILED) Die("mmap for writing failed");
    std::memcpy(w, rows.data(), bytes_);
    munmap(w, bytes_);
    close(fd);
  }
  ~ShmObject() { shm_unlink(name_.c_str()); }
  ShmObject(const ShmObject&) = delete;
  ShmObject& operator=(const ShmObject&) = delete;

  const std::string& name() const { return name_; }

  // A read-only shared mapping, as ShmRegion makes it (no MAP_POPULATE).
  const uint8_t* MapReadOnly() const {
    const int fd = shm_open(name_.c_str(), O_RDONLY, 0);
    if (fd < 0) Die("shm_open for reading failed");
    void* p = mmap(nullptr, bytes_, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) Die("mmap for reading failed");
    return static_cast<const uint8_t*>(p);
  }
  void Unmap(const uint8_t* p) const { munmap(const_cast<uint8_t*>(p), bytes_); }

 private:
  const std::string name_;
  const size_t bytes_;
};

// Anonymous memory holding a copy of `rows`; 4 KiB pages when `no_huge`.
uint8_t* AnonymousCopy(const std::vector<uint8_t>& rows, bool no_huge) {
  void* p = mmap(nullptr, rows.size(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) Die("anonymous mmap failed");
  if (no_huge) madvise(p, rows.size(), MADV_NOHUGEPAGE);
  std::memcpy(p, rows.data(), rows.size());
  return static_cast<uint8_t*>(p);
}

// A one-layer page-size-64 cache big enough for `rows`, and params that
// place the rows at positions [0, rows) of one request (by segment, as the
// cpu backend calls it). Only the row pointers change between sources.
struct QuantizeTarget {
  std::vector<uint8_t> ckv, sf, kpe;
  std::vector<int32_t> kv_indices, kv_indptr, seg_indptr, seg_request, seg_start;
  QuantizeAppendParams params;

  explicit QuantizeTarget(int64_t rows) {
    const int32_t pages = static_cast<int32_t>((rows + kPageSize - 1) / kPageSize);
    ckv.assign(static_cast<size_t>(pages) * kPageSize * 256, 0);
    sf.assign(static_cast<size_t>(pages) * kPageSize * 32, 0);
    kpe.assign(static_cast<size_t>(pages) * kPageSize * 64, 0);
    for (int32_t i = 0; i < pages; ++i) kv_indices.push_back(i);
    kv_indptr = {0, pages};
    seg_indptr = {0, static_cast<int32_t>(rows)};
    seg_request = {0};
    seg_start = {0};
    QuantizeAppendParams& p = params;
    p.num_rows = rows;
    p.segment_indptr = seg_indptr.data();
    p.segment_request = seg_request.data();
    p.segment_start = seg_start.data();
    p.num_segments = 1;
    p.ckv_cache = ckv.data();
    p.ckv_sf_cache = sf.data();
    p.kpe_cache = kpe.data();
    p.num_pages = pages;
    p.page_size = kPageSize;
    p.kv_indices = kv_indices.data();
    p.kv_indptr = kv_indptr.data();
    p.batch_size = 1;
    p.num_kv_indices = pages;
    p.ckv_scale = 1.0f;
    p.kpe_scale = 1.0f;
    if (absl::Status s = ValidateRowPlacement(p); !s.ok()) Die(std::string(s.message()));
  }
};

// ---- part (a) -----------------------------------------------------------------

enum Source { kShmGuarded, kShmUnguarded, kAnonymous, kAnonymousSmallPages, kShmFreshMapping, kSources };

const char* SourceName(int s) {
  switch (s) {
    case kShmGuarded: return "shm, registered with the guard";
    case kShmUnguarded: return "shm, same mapping, not registered";
    case kAnonymous: return "anonymous (THP as configured)";
    case kAnonymousSmallPages: return "anonymous, MADV_NOHUGEPAGE";
    case kShmFreshMapping: return "shm, fresh mapping, first read (registered)";
  }
  return "?";
}

// One run's wall time and the calling thread's CPU time (user + system, so
// page faults count), ms. On a shared machine the CPU time leaves out the
// time the thread waited for a core, which is most of the wall-clock noise.
struct Timing {
  double wall_ms = 0, cpu_ms = 0;
};

double ThreadCpuMs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

Timing TimeMs(const std::function<void(const uint8_t*)>& op, const uint8_t* src) {
  const double c0 = ThreadCpuMs();
  const Clock::time_point t0 = Clock::now();
  op(src);
  return {Micros(Clock::now() - t0) * 1e-3, ThreadCpuMs() - c0};
}

// The orders the four steady-state sources run in, one per repeat in turn:
// each source takes each position once, and the two shm variants (one
// mapping, the same physical pages) follow each other equally often. With a
// plain rotation the second of them always found more of the rows still in
// the L3 and came out ~12% faster at 4 MiB, whichever was second.
constexpr int kOrders[4][4] = {{kShmGuarded, kShmUnguarded, kAnonymous, kAnonymousSmallPages},
                               {kShmUnguarded, kShmGuarded, kAnonymousSmallPages, kAnonymous},
                               {kAnonymous, kAnonymousSmallPages, kShmGuarded, kShmUnguarded},
                               {kAnonymousSmallPages, kAnonymous, kShmUnguarded, kShmGuarded}};

// Two untimed runs: one left the rows of a 4 MiB source partly outside the
// L3 when the source before it read other memory.
void Warm(const std::function<void(const uint8_t*)>& op, const uint8_t* src) {
  op(src);
  op(src);
}

// One timed run of `op` from source `s`, after untimed runs from the same
// memory so that every source starts with as much of its rows in the caches
// and its pages in the TLB as they hold (otherwise each run's state depends
// on which source ran before it and what it evicted or unmapped). The guard is registered only
// around the run that is meant to have it. A fresh mapping is made and
// unmapped around its run (untimed); its warm-up reads the same physical
// pages through the old mapping, so what its run adds is the first touch of
// each page through the new mapping (the page-table entries).
Timing RunFrom(int s, const std::function<void(const uint8_t*)>& op, const ShmObject& shm, const uint8_t* mapping,
               size_t bytes, const uint8_t* anon, const uint8_t* anon_small) {
  switch (s) {
    case kShmGuarded: {
      absl::StatusOr<std::unique_ptr<MappingFaultGuard>> guard = MappingFaultGuard::Register(mapping, bytes);
      if (!guard.ok()) Die(std::string(guard.status().message()));
      Warm(op, mapping);
      const Timing t = TimeMs(op, mapping);
      if ((*guard)->faulted()) Die("the guard saw a fault");
      return t;
    }
    case kShmUnguarded: return Warm(op, mapping), TimeMs(op, mapping);
    case kAnonymous: return Warm(op, anon), TimeMs(op, anon);
    case kAnonymousSmallPages: return Warm(op, anon_small), TimeMs(op, anon_small);
    case kShmFreshMapping: {
      Warm(op, mapping);
      const uint8_t* fresh = shm.MapReadOnly();
      Timing t;
      {
        absl::StatusOr<std::unique_ptr<MappingFaultGuard>> guard = MappingFaultGuard::Register(fresh, bytes);
        if (!guard.ok()) Die(std::string(guard.status().message()));
        t = TimeMs(op, fresh);
      }
      shm.Unmap(fresh);
      return t;
    }
  }
  return {};
}

void PrintSourceRows(const char* size, const char* op, double mib, std::vector<Timing> (&runs)[kSources]) {
  auto column = [&](int s, double Timing::*field) {
    std::vector<double> v;
    for (const Timing& t : runs[s]) v.push_back(t.*field);
    return Summarize(v);
  };
  const double wall_base = column(kShmUnguarded, &Timing::wall_ms).p50;
  const double cpu_base = column(kShmUnguarded, &Timing::cpu_ms).p50;
  for (int s = 0; s < kSources; ++s) {
    const Summary wall = column(s, &Timing::wall_ms), cpu = column(s, &Timing::cpu_ms);
    std::printf("| %s | %s | %s | %.3f | %.3f-%.3f | %.3f | %.3f-%.3f | %.2f | %.3f | %.3f |\n", size, op,
                SourceName(s), wall.p50, wall.min, wall.p90, cpu.p50, cpu.min, cpu.p90,
                mib / 1024.0 / (cpu.p50 * 1e-3), wall.p50 / wall_base, cpu.p50 / cpu_base);
  }
}

void RunSize(int mib, int repeats, int threads) {
  const int64_t rows = (static_cast<int64_t>(mib) << 20) / kRowBytes;
  const std::vector<uint8_t> data = RandomRows(rows);
  const size_t bytes = data.size();
  const ShmObject shm(data, absl::StrFormat("%dmib", mib));
  const uint8_t* mapping = shm.MapReadOnly();
  const uint8_t* anon = AnonymousCopy(data, false);
  const uint8_t* anon_small = AnonymousCopy(data, true);
  std::vector<uint8_t> dest(bytes, 1);  // prefaulted
  QuantizeTarget target(rows);

  const std::function<void(const uint8_t*)> copy = [&](const uint8_t* src) { std::memcpy(dest.data(), src, bytes); };
  const std::function<void(const uint8_t*)> quantize = [&](const uint8_t* src) {
    QuantizeAppendParams p = target.params;
    p.append_ckv = src;
    p.append_kpe = src + rows * kCkvRowBytes;
    QuantizeAppendHost(p, threads);
  };
  for (const auto* op : {&copy, &quantize}) {
    std::vector<Timing> ms[kSources];
    // The four steady-state sources take turns in counterbalanced orders
    // (kOrders). The fresh mapping runs in a loop of its own.
    for (int r = 0; r < repeats; ++r) {
      for (int s : kOrders[r % 4]) ms[s].push_back(RunFrom(s, *op, shm, mapping, bytes, anon, anon_small));
    }
    for (int r = 0; r < repeats; ++r) {
      ms[kShmFreshMapping].push_back(RunFrom(kShmFreshMapping, *op, shm, mapping, bytes, anon, anon_small));
    }
    PrintSourceRows(absl::StrFormat("%d MiB (%lld rows)", mib, static_cast<long long>(rows)).c_str(),
                    op == &copy ? "memcpy" : absl::StrFormat("quantize, %d thread(s)", threads).c_str(),
                    static_cast<double>(bytes) / (1 << 20), ms);
  }
  shm.Unmap(mapping);
  munmap(const_cast<uint8_t*>(anon), bytes);
  munmap(const_cast<uint8_t*>(anon_small), bytes);
}

// ---- part (b) -----------------------------------------------------------------

void CheckOk(const grpc::Status& s, const char* what) {
  if (!s.ok()) Die(absl::StrFormat("%s failed: %d %s", what, static_cast<int>(s.error_code()), s.error_message()));
}

// The 4 MiB Append message, rows named in region `region` or carried as bytes.
v1::AppendRequest AppendMessage(int64_t rows, const std::vector<uint8_t>& data, const std::string& region) {
  v1::AppendRequest m;
  m.set_sequence("e2e");
  m.set_row_count(static_cast<uint32_t>(rows));
  m.set_dtype(v1::ROW_DTYPE_BFLOAT16);
  m.set_view(v1::SEQUENCE_VIEW_BASIC);
  m.set_expect_length(0);
  v1::LayerRows* lr = m.add_layers();
  lr->set_layer(0);
  const uint64_t kpe_offset = static_cast<uint64_t>(rows) * kCkvRowBytes;
  if (region.empty()) {
    lr->set_ckv(data.data(), kpe_offset);
    lr->set_kpe(data.data() + kpe_offset, static_cast<uint64_t>(rows) * kKpeRowBytes);
  } else {
    lr->mutable_ckv_ref()->set_region(region);
    lr->mutable_ckv_ref()->set_offset(0);
    lr->mutable_kpe_ref()->set_region(region);
    lr->mutable_kpe_ref()->set_offset(kpe_offset);
  }
  return m;
}

// One timed Append stream of `m` (us); the sequence is freed afterwards, untimed.
double TimedAppend(v1::KvCache::Stub& stub, const v1::AppendRequest& m) {
  const Clock::time_point t0 = Clock::now();
  grpc::ClientContext ctx;
  v1::AppendResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::AppendRequest>> writer = stub.Append(&ctx, &resp);
  writer->Write(m);
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  const double us = Micros(Clock::now() - t0);
  CheckOk(status, "Append");
  grpc::ClientContext free_ctx;
  v1::FreeSequenceRequest free_req;
  free_req.set_sequence(m.sequence());
  v1::FreeSequenceResponse free_resp;
  CheckOk(stub.FreeSequence(&free_ctx, free_req, &free_resp), "FreeSequence");
  return us;
}

double TimedGetPool(v1::KvCache::Stub& stub) {
  const Clock::time_point t0 = Clock::now();
  grpc::ClientContext ctx;
  v1::Pool resp;
  CheckOk(stub.GetPool(&ctx, v1::GetPoolRequest(), &resp), "GetPool");
  return Micros(Clock::now() - t0);
}

void PrintE2eRow(const char* what, const std::vector<double>& us, double mib) {
  const Summary s = Summarize(us);
  std::printf("| %s | %zu | %.0f | %.0f | %.0f | %.0f | %s |\n", what, s.n, s.p50, s.p99, s.min, s.max,
              mib > 0 ? absl::StrFormat("%.2f", mib / 1024.0 / (s.p50 * 1e-6)).c_str() : "");
}

void RunEndToEnd(int repeats) {
  const int64_t rows = (int64_t{4} << 20) / kRowBytes;
  const std::vector<uint8_t> data = RandomRows(rows);
  const ShmObject shm(data, "e2e");
  KvCacheServer::Options options;
  v1::PoolConfig* pool = options.config.add_pools();
  pool->set_name("default");
  pool->set_device("cpu");
  pool->set_num_layers(1);
  pool->set_page_size(kPageSize);
  pool->set_num_pages(1024);
  pool->mutable_all_layers()->set_ckv_scale(1.0f);
  pool->mutable_all_layers()->set_kpe_scale(1.0f);
  options.allow_ipc = true;
  absl::StatusOr<std::unique_ptr<KvCacheServer>> server = KvCacheServer::Create(options);
  if (!server.ok()) Die(std::string(server.status().message()));
  auto stub = v1::KvCache::NewStub((*server)->InProcessChannel());
  {
    grpc::ClientContext ctx;
    v1::RegisterShmRegionRequest req;
    req.set_name("rows");
    req.set_shm_name(shm.name());
    v1::Region resp;
    CheckOk(stub->RegisterShmRegion(&ctx, req, &resp), "RegisterShmRegion");
  }
  const v1::AppendRequest by_region = AppendMessage(rows, data, "rows");
  const v1::AppendRequest by_bytes = AppendMessage(rows, data, "");
  for (int i = 0; i < 5; ++i) TimedAppend(*stub, by_region), TimedAppend(*stub, by_bytes), TimedGetPool(*stub);
  std::vector<double> region_us, bytes_us, floor_us;
  for (int r = 0; r < repeats; ++r) {
    // Alternate which goes first, so neither always follows the other.
    if (r % 2 == 0) {
      region_us.push_back(TimedAppend(*stub, by_region));
      bytes_us.push_back(TimedAppend(*stub, by_bytes));
    } else {
      bytes_us.push_back(TimedAppend(*stub, by_bytes));
      region_us.push_back(TimedAppend(*stub, by_region));
    }
    floor_us.push_back(TimedGetPool(*stub));
  }
  const double mib = static_cast<double>(data.size()) / (1 << 20);
  std::printf("\n### (b) Append of %lld rows (%.2f MiB) end to end, in-process server, cpu backend, us\n\n",
              static_cast<long long>(rows), mib);
  std::printf("| call | calls | p50 | p99 | min | max | GiB/s at p50 |\n|---|---|---|---|---|---|---|\n");
  PrintE2eRow("Append, rows in a registered shm region", region_us, mib);
  PrintE2eRow("Append, same rows as bytes", bytes_us, mib);
  PrintE2eRow("GetPool (floor of any call)", floor_us, 0);
}

int Main() {
  spdlog::set_level(spdlog::level::warn);  // the in-process server's start/stop lines
  // As mlakv-server does (server/main.cc): multi-MB message buffers stay in the heap.
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
  const int repeats = (std::max(4, absl::GetFlag(FLAGS_repeats)) + 3) / 4 * 4;  // whole cycles of kOrders
  const int threads = std::max(1, absl::GetFlag(FLAGS_threads));
  std::printf("shm_guard_bench: %d repeats, quantize on %d thread(s), load average %.2f\n\n", repeats, threads,
              LoadAverage());
  std::printf("### (a) Reading rows from each source, ms: median of %d runs (min-p90); wall clock and the thread's "
              "CPU time\n\n", repeats);
  std::printf("| rows | operation | source | wall | wall min-p90 | CPU | CPU min-p90 | GiB/s of CPU | "
              "wall / unregistered shm | CPU / unregistered shm |\n|---|---|---|---|---|---|---|---|---|---|\n");
  RunSize(4, repeats, threads);
  RunSize(64, repeats, threads);
  RunEndToEnd(std::max(10, absl::GetFlag(FLAGS_e2e_repeats)));
  std::printf("\nload average at the end: %.2f\n", LoadAverage());
  return 0;
}

}  // namespace
}  // namespace mlakv::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return mlakv::bench::Main();
}
