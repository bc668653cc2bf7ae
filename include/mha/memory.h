// Tensor memory that mha allocated: the bytes in use now and the most in use
// since the last reset_peak_memory(). Views share their storage and count
// once; memory wrapped by Tensor::from_blob is not counted.
#pragma once

#include <cstdint>

namespace mha {

int64_t active_memory();
int64_t peak_memory();
void reset_peak_memory();  // the peak becomes the active memory

// The most tensor memory mha holds at once. A tensor that would take it past
// the limit is refused with MemoryError before anything is allocated (a shape
// whose byte count overflows too), so that a mistyped size is an error, not
// the kernel's OOM killer. The default is the machine's memory (its cgroup's
// limit where that is lower); set_memory_limit(0) returns to it. An
// allocation the system refuses below the limit is a MemoryError as well.
int64_t memory_limit();
void set_memory_limit(int64_t bytes);  // bytes >= 0 (ValueError otherwise)

}  // namespace mha
