// Tensor memory that mha allocated: the bytes in use now and the most in use
// since the last reset_peak_memory(). Views share their storage and count
// once; memory wrapped by Tensor::from_blob is not counted.
#pragma once

#include <cstdint>

namespace mha {

int64_t active_memory();
int64_t peak_memory();
void reset_peak_memory();  // the peak becomes the active memory

}  // namespace mha
