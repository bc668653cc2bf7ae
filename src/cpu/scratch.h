// Grow-only scratch memory of the calling thread, by slot, for kernels that
// need a buffer per call: once a thread has met the largest size, a steady
// state touches no fresh pages (a page fault costs ~2 µs on these VMs, as
// much as 100k FMAs). 64-byte aligned; freed when the thread exits. An
// ordinary function, so that translation units built for other instruction
// sets call it instead of each instantiating containers of their own.
#pragma once

#include <cstdint>

namespace mha::cpu {

// One slot per use that may be live at the same time as the others.
enum class ScratchSlot : int { sgemm_b, sgemm_rows, bgemm_b, bgemm_rows, count };

// At least `bytes` bytes; the contents are unspecified.
void* thread_scratch_bytes(ScratchSlot slot, int64_t bytes);

}  // namespace mha::cpu
