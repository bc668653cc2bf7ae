// Counters of tensor memory (mha/memory.h), kept by Storage.
#include "mha/memory.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>

#include "check.h"
#include "storage.h"

namespace mha {

namespace {
std::atomic<int64_t> active{0}, peak{0};
}  // namespace

void track_memory(int64_t bytes) {
  const int64_t now = active.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

namespace {

std::atomic<int64_t> limit{0};  // 0: the machine's memory

// Physical memory, or the cgroup's limit (v2, then v1) where lower.
int64_t machine_memory() {
  static const int64_t bytes = [] {
    int64_t m = int64_t(sysconf(_SC_PHYS_PAGES)) * int64_t(sysconf(_SC_PAGESIZE));
    for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
      std::ifstream f(path);
      int64_t cap = 0;
      if (f >> cap && cap > 0) m = std::min(m, cap);  // "max" (no limit) does not parse
    }
    return m > 0 ? m : std::numeric_limits<int64_t>::max();
  }();
  return bytes;
}

// 1.5 MiB, 64 GiB, ...: three significant digits in the largest unit below the size.
std::string gib(double bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (u < 6 && bytes >= 1024) bytes /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g %s", bytes, units[u]);
  return buf;
}

}  // namespace

int64_t memory_limit() {
  const int64_t l = limit.load(std::memory_order_relaxed);
  return l > 0 ? l : machine_memory();
}

void set_memory_limit(int64_t bytes) {
  if (bytes < 0) raise<ValueError>("mha::set_memory_limit", "bytes", ">= 0 (0: the machine's memory)", std::to_string(bytes));
  limit.store(bytes, std::memory_order_relaxed);
}

size_t checked_bytes(const Shape& shape, DType dtype, const char* fn) {
  uint64_t bytes = uint64_t(dtype_size(dtype));
  bool overflow = false;
  for (int64_t d : shape) overflow |= __builtin_mul_overflow(bytes, uint64_t(d), &bytes);
  const int64_t in_use = active_memory(), cap = memory_limit();
  // Named only on the way to an error: every tensor allocation passes here.
  const auto what = [&] { return "shape " + shape_string(shape) + " of " + to_string(dtype); };
  if (overflow || bytes > uint64_t(std::numeric_limits<int64_t>::max()))
    raise<MemoryError>(fn, what(), "a size that fits in 2^63 bytes", "one that does not");
  if (int64_t(bytes) > cap - in_use)
    raise<MemoryError>(fn, what(),
                       "at most " + gib(double(std::max<int64_t>(0, cap - in_use))) + " more (the limit " + gib(double(cap)) +
                           (limit.load(std::memory_order_relaxed) > 0 ? " set by set_memory_limit" : ", the machine's memory") +
                           ", less " + gib(double(in_use)) + " in use)",
                       gib(double(bytes)));
  return size_t(bytes);
}

int64_t active_memory() { return active.load(std::memory_order_relaxed); }
int64_t peak_memory() { return peak.load(std::memory_order_relaxed); }
void reset_peak_memory() { peak.store(active.load(std::memory_order_relaxed), std::memory_order_relaxed); }

}  // namespace mha
