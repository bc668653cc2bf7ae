// Fast checks for NaN and infinity in a result, for the paths that hand a
// non-finite result to an exact path (see cpu/backend.cpp).
#pragma once

#include "mha/tensor.h"

namespace mha {

// Whether t holds no NaN and no infinity (-inf allowed when minus_inf_ok:
// the lse of a fully masked row). Integer and bool tensors are finite.
bool all_finite(const Tensor& t, bool minus_inf_ok = false);

}  // namespace mha
