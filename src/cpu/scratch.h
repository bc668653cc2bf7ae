// Grow-only scratch memory of the calling thread, by slot, for kernels that
// need a buffer per call: once a thread has met the largest size, a steady
// state touches no fresh pages (a page fault costs ~2 µs on these VMs, as
// much as 100k FMAs). 64-byte aligned; freed when the thread exits. An
// ordinary function, so that translation units built for other instruction
// sets call it instead of each instantiating containers of their own.
//
// A refused allocation throws mha::MemoryError; the slot is then empty and
// the thread's other slots are as they were. An exception may not leave an
// OpenMP region, so a kernel takes the scratch of its region's threads
// before the region (PerThread below); a region that cannot (its work calls
// a product, which takes its own) runs through a RegionErrors (parallel.h).
#pragma once

#include <cstdint>

namespace mha::cpu {

// One slot per use that may be live at the same time as the others.
enum class ScratchSlot : int {
  sgemm_b, sgemm_rows,              // cpu/sgemm: packed B panel, packed A rows
  bgemm_b, bgemm_rows,              // the same for bfloat16 pairs
  widen_a, widen_b,                 // bfloat16 operands widened to float32 (cpu/gemm.cpp)
  gemm_t,                           // a product computed as its transpose (cpu/gemm.cpp)
  flash_a, flash_b, flash_c, flash_d,  // cpu/flash: per-tile operands, work, outputs
  layer_a, layer_b, layer_c,        // cpu/layers: partial sums
  count
};

// At least `bytes` bytes; the contents are unspecified.
void* thread_scratch_bytes(ScratchSlot slot, int64_t bytes);

// `bytes` bytes for each thread of the region that follows, taken from the
// calling thread's slot before the region: slice t for thread t, 64-byte
// aligned, never sharing a line (scratch.cpp says how far apart). The team
// has at most omp_get_max_threads() threads (one when nested in another).
struct PerThread {
  char* base;
  int64_t stride;
};
PerThread per_thread_scratch(ScratchSlot slot, int64_t bytes);

// The slice of the calling thread (by its number in the current team).
void* own_slice(const PerThread& p);

}  // namespace mha::cpu
