// Small helpers shared by the host-side benchmark programs: latency
// percentiles, wall-clock timing, and this process's memory use.
#pragma once

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace mlakv::bench {

using Clock = std::chrono::steady_clock;

// A benchmark that cannot set itself up or finds a wrong answer: prints
// "PROGRAM: WHAT" on stderr and exits 1 (a figure from a broken run is worse
// than none).
[[noreturn]] inline void Die(const char* program, const std::string& what) {
  std::fprintf(stderr, "%s: %s\n", program, what.c_str());
  std::exit(1);
}

inline double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// Percentiles of a sample set (nearest rank on the sorted copy).
struct Summary {
  size_t n = 0;
  double p50 = 0, p90 = 0, p99 = 0, max = 0, min = 0;
};

inline Summary Summarize(std::vector<double> v) {
  Summary s;
  s.n = v.size();
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))]; };
  s.p50 = at(0.50);
  s.p90 = at(0.90);
  s.p99 = at(0.99);
  s.max = v.back();
  s.min = v.front();
  return s;
}

inline double Median(std::vector<double> v) { return Summarize(std::move(v)).p50; }

// Resident set size (what an operator's `ps` shows) and bytes the heap has
// handed out and not taken back (mallinfo2: small blocks + mmapped ones).
// The heap figure ignores free chunks glibc keeps, so it isolates what live
// objects hold; RSS includes those chunks and touched cache pages.
struct MemoryUse {
  uint64_t rss_bytes = 0;
  uint64_t heap_bytes = 0;
};

inline MemoryUse ReadMemory() {
  MemoryUse m;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    unsigned long long size = 0, resident = 0;
    if (std::fscanf(f, "%llu %llu", &size, &resident) == 2) {
      m.rss_bytes = resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    }
    std::fclose(f);
  }
  const struct mallinfo2 mi = mallinfo2();
  m.heap_bytes = mi.uordblks + mi.hblkhd;
  return m;
}

// The 1-minute load average: how busy the shared machine was around a run.
inline double LoadAverage() {
  double one = 0;
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &one) != 1) one = 0;
    std::fclose(f);
  }
  return one;
}

}  // namespace mlakv::bench
