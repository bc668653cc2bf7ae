// Fast checks for NaN and infinity in a result, for the paths that hand a
// non-finite result to an exact path (see cpu/backend.cpp).
#pragma once

#include "mha/tensor.h"

namespace mha {

// Whether t holds no NaN and no infinity (-inf allowed when minus_inf_ok:
// the lse of a fully masked row). Integer and bool tensors are finite.
bool all_finite(const Tensor& t, bool minus_inf_ok = false);

// The same for n values at x: tested on the exponent bits without a branch,
// so that the loop vectorises (a result just written is still in cache).
bool all_finite(const float* x, int64_t n, bool minus_inf_ok = false);
bool all_finite(const double* x, int64_t n, bool minus_inf_ok = false);

// rows × cols floats, rows `pitch` apart.
bool all_finite(const float* x, int64_t rows, int64_t cols, int64_t pitch);

}  // namespace mha
