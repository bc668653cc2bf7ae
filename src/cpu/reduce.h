// Folding per-batch-entry gradients back onto an input's shape: broadcast
// dims and grouped-query heads are summed, in batch order (deterministic).
#pragma once

#include <vector>

#include "attention_params.h"
#include "dtype_dispatch.h"

namespace mha::cpu {

// full holds one (rows × cols) block per output batch entry b = 0 … batch-1;
// grad (contiguous, shaped like the input) receives Σ over the entries that
// read each of its blocks.
template <class A>
void store_reduced(const std::vector<A>& full, const AttentionParams& p, Tensor& grad) {
  const Shape& shape = grad.shape();
  const int64_t inner = shape[shape.size() - 2] * shape[shape.size() - 1];
  const Shape lead(shape.begin(), shape.end() - 2);
  const Shape strides = contiguous_strides(shape);
  const std::vector<int64_t> offset = batch_offsets(p.batch_shape, lead, Shape(strides.begin(), strides.end() - 2));
  std::vector<A> acc(size_t(grad.numel()), A(0));
  for (size_t b = 0; b < offset.size(); ++b)
    for (int64_t x = 0; x < inner; ++x) acc[size_t(offset[b] + x)] += full[b * size_t(inner) + size_t(x)];
  dispatch_dtype(grad.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, bool> && !std::is_same_v<T, int64_t>) {
      T* dst = grad.data<T>();
      for (size_t x = 0; x < acc.size(); ++x) dst[x] = store_as<T>(acc[x]);
    }
  });
}

}  // namespace mha::cpu
