// Counters of tensor memory (mha/memory.h), kept by Storage.
#include "mha/memory.h"

#include <atomic>

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

int64_t active_memory() { return active.load(std::memory_order_relaxed); }
int64_t peak_memory() { return peak.load(std::memory_order_relaxed); }
void reset_peak_memory() { peak.store(active.load(std::memory_order_relaxed), std::memory_order_relaxed); }

}  // namespace mha
