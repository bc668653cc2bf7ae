// The host allocator with a cache of large blocks (policy in allocator.h).
#include "cpu/allocator.h"
#include "mha/errors.h"

#include <malloc.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>

namespace mha::cpu {

namespace {

constexpr size_t kLarge = size_t(1) << 16, kMinCap = size_t(256) << 20;

// The size a cached block is made with: four classes an octave (2^k·{1,
// 1.25, 1.5, 1.75}), so that a block serves every request up to 25% smaller
// than it. A training batch's lengths vary from step to step, and so do its
// activations' sizes; with exact sizes few blocks were ever reused, and the
// small copy step took ~1,050 fresh pages a step (perf stat). Pages of a
// block's tail that nothing writes are never made resident.
size_t size_class(size_t bytes) {
  const size_t octave = size_t(1) << (63 - __builtin_clzll(bytes));
  const size_t step = octave / 4;
  return (bytes + step - 1) / step * step;
}

struct Idle {
  void* ptr;
  uint64_t freed;  // when, in frees: the oldest goes first
};

struct Cache {
  std::mutex mutex;
  struct Block {
    size_t size;  // its size class
    size_t huge;  // bytes from its start asked to be huge pages
  };
  std::unordered_map<void*, Block> size_of;  // every large block alive or cached
  std::multimap<size_t, Idle> idle;           // cached blocks by size
  size_t idle_bytes = 0;
  uint64_t frees = 0;
};

// Never destroyed: tensors freed during static destruction still find it.
Cache& cache() {
  static Cache* c = new Cache;
  return *c;
}

constexpr size_t kHuge = size_t(2) << 20;

// `bytes` 64-byte aligned; on a 2 MiB boundary where a block of that size
// could hold huge pages (a cached block serves any request of its size
// class), so that ask_huge can give them to whichever request it serves.
void* aligned(size_t bytes) {
  if (kHostBlockCache && huge_page_extent(bytes) > 0)
    if (void* p = std::aligned_alloc(kHuge, (bytes + kHuge - 1) / kHuge * kHuge)) return p;
  void* p = std::aligned_alloc(64, bytes);
  if (!p)
    throw MemoryError("[mha::cpu::host_allocate] bytes: expected an allocation the system grants; got a refusal of " +
                      std::to_string(bytes) + " bytes");
  return p;
}

// Transparent huge pages ("madvise" mode, Debian's default) over
// huge_page_extent(used) of a cached block on a 2 MiB boundary, where the
// block has fewer: its first request's when it is made, and a larger one's
// when a block made for a smaller request of its class serves it (a batch's
// lengths vary; pages already touched as 4 KiB ones stay so). A layer's
// strided reads of a 4-16 MiB activation (packing a product's operand down
// its columns, the heads of (N, L, H·E)) took a TLB entry per 4 KiB row;
// long training 12.2-12.8k -> 12.9-13.0k tokens/s, mid 9.23-9.31k ->
// 9.42-9.56k (alternating runs, blocks from 4 MiB up). Only the pages inside
// `used`, or nearly: a huge page is resident whole once touched, and rounding
// up (or the size class's tail) made 28 MiB more resident at mid (PyTorch
// with mha's layers, 358 -> 386 MiB, past PyTorch's own 361-371).
//
// From 2 MiB up (one page less 1/16), not 4 MiB: long's K and V copies and
// attention output, (2, 4, 2040, 64) floats, are 16 KiB short of 4 MiB. The
// attention forward at (8, L, 64) causal, one thread, alternating in one
// process: 35k cycles a tile pair at L = 2048 (4 MiB tensors, huge pages),
// 40-51k at L = 2039 and 1984 on 4 KiB pages, 36-37k with huge pages. Long
// training, alternating with blocks from 4 MiB up: AVX-512 12.35-12.86k ->
// 12.86-13.49k tokens/s (eight rounds, +2.1 to +5.3%), AVX2 code 8.28-8.68k
// -> 8.55-9.28k (three, +3 to +7%); peak 500.7 -> 502.0 MiB; mid, small and
// wide inside the noise. Widening a reused block's pages: attention at L =
// 2048 then 2112 in one process (the kept scores' block passing from one to
// the other), 2112's forward 44k -> 34k cycles a tile pair; long training +3%
// (median of six paired rounds, 0.97-1.06), mid even (0.98-1.04).
void ask_huge(void* p, Cache::Block& block, size_t used) {
  const size_t extent = huge_page_extent(used);
  if (extent <= block.huge || reinterpret_cast<uintptr_t>(p) % kHuge != 0) return;
  madvise(p, extent, MADV_HUGEPAGE);
  block.huge = extent;
}

// peak resets (reset_host_bytes_peak); high_water, the cache's cap, never does.
std::atomic<size_t> in_use{0}, peak{0}, high_water{0}, blocks_made{0};

void raise_to(std::atomic<size_t>& mark, size_t now) {
  for (size_t seen = mark.load(std::memory_order_relaxed);
       now > seen && !mark.compare_exchange_weak(seen, now, std::memory_order_relaxed);) {
  }
}

// Every block handed out or taken back, counted by its usable size.
void* handed_out(void* p) {
  const size_t now = in_use.fetch_add(malloc_usable_size(p), std::memory_order_relaxed) + malloc_usable_size(p);
  raise_to(peak, now);
  raise_to(high_water, now);
  return p;
}

// A large block from the system, counted (host_blocks_made).
void* fresh(size_t bytes) {
  void* p = aligned(bytes);
  blocks_made.fetch_add(1, std::memory_order_relaxed);
  return p;
}

// Frees the least recently cached idle blocks until `bytes` more fit under
// `cap` (the caller holds the lock). A scan per block evicted: the cache holds
// tens to hundreds of blocks, and evicts only when the shapes in use change.
void evict_for(Cache& c, size_t bytes, size_t cap) {
  while (!c.idle.empty() && c.idle_bytes + bytes > cap) {
    auto oldest = c.idle.begin();
    for (auto it = c.idle.begin(); it != c.idle.end(); ++it)
      if (it->second.freed < oldest->second.freed) oldest = it;
    c.idle_bytes -= oldest->first;
    c.size_of.erase(oldest->second.ptr);
    std::free(oldest->second.ptr);
    c.idle.erase(oldest);
  }
}

}  // namespace

size_t host_bytes_in_use() { return in_use.load(std::memory_order_relaxed); }
size_t host_bytes_peak() { return peak.load(std::memory_order_relaxed); }
size_t host_blocks_made() { return blocks_made.load(std::memory_order_relaxed); }
void reset_host_bytes_peak() { peak.store(in_use.load(std::memory_order_relaxed), std::memory_order_relaxed); }

size_t huge_page_extent(size_t used) {
  const size_t whole = used / kHuge * kHuge;
  return used - whole >= kHuge - kHuge / 16 ? whole + kHuge : whole;
}

void* host_allocate(size_t bytes) {
  size_t rounded = (bytes + 63) / 64 * 64;
  if (rounded == 0) rounded = 64;
  if (rounded < kLarge) return handed_out(aligned(rounded));
  if (!kHostBlockCache) return handed_out(fresh(rounded));
  rounded = size_class(rounded);
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    auto it = c.idle.find(rounded);
    if (it != c.idle.end()) {
      void* p = it->second.ptr;
      c.idle.erase(it);
      c.idle_bytes -= rounded;
      ask_huge(p, c.size_of.at(p), bytes);  // every idle block is in size_of
      return handed_out(p);
    }
    // A miss: a fresh block's pages are new to the process. Idle blocks
    // that would lift what it holds (in use, idle and this block) past a
    // quarter over the most ever in use go first, oldest first (a quarter:
    // a size class's slack). The cache's own cap (host_free) alone let idle
    // blocks of sizes no longer asked for stay beside fresh ones: training at
    // long held 306 MiB for tensors peaking at 206, now 262-264 (mid 234 ->
    // 224, wide 1266 -> 1217; tokens/s and steady-state page faults even).
    const size_t used = in_use.load(std::memory_order_relaxed) + rounded;
    const size_t hw = std::max(high_water.load(std::memory_order_relaxed), used);
    evict_for(c, used, hw + hw / 4);
  }
  void* p = fresh(rounded);
  std::lock_guard<std::mutex> lock(c.mutex);
  try {
    ask_huge(p, c.size_of[p] = {rounded, 0}, bytes);
  } catch (...) {  // the map's node refused: the block is not lost
    std::free(p);
    throw;
  }
  return handed_out(p);
}

void host_free(void* ptr) {
  if (!ptr) return;
  in_use.fetch_sub(malloc_usable_size(ptr), std::memory_order_relaxed);
  if (kHostBlockCache) {
    Cache& c = cache();
    std::unique_lock<std::mutex> lock(c.mutex);
    auto it = c.size_of.find(ptr);
    if (it != c.size_of.end()) {
      const size_t n = it->second.size;
      const size_t cap = std::max(kMinCap, high_water.load(std::memory_order_relaxed));
      if (n <= cap) {
        try {
          evict_for(c, n, cap);
          c.idle.insert({n, Idle{ptr, ++c.frees}});
          c.idle_bytes += n;
          return;
        } catch (const std::bad_alloc&) {
          // host_free runs in destructors: a refused node means no caching, not std::terminate
        }
      }
      c.size_of.erase(it);
    }
  }
  std::free(ptr);
}

}  // namespace mha::cpu
