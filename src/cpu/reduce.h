// Folding per-batch-entry gradients back onto an input's shape: broadcast
// dims and grouped-query heads are summed, in batch order (deterministic).
#pragma once

#include <vector>

#include "attention_params.h"
#include "cpu/layers/layers.h"
#include "dtype_dispatch.h"

namespace mha::cpu {

// full holds one (rows × cols) block per output batch entry b = 0 … batch-1;
// grad (shaped like the input) receives Σ over the entries that read each of
// its blocks. Where each block of grad is read by exactly one entry, in order
// (no broadcast, no grouped heads: every layer's attention), there is nothing
// to sum: full is converted straight into grad (bfloat16 by round_to_bf16,
// vectorised and threaded), with no accumulator between; into a view with
// one block per entry (attention_backward_into: rows apart, unit last
// stride) row by row. Sums into another view go through a contiguous copy.
template <class A>
void store_reduced(const A* full, const AttentionParams& p, Tensor& grad) {
  const Shape& shape = grad.shape();
  const Shape lead(shape.begin(), shape.end() - 2);
  if (!grad.is_contiguous()) {
    if (lead != p.batch_shape) {
      Tensor whole = Tensor::empty(shape, grad.dtype());
      store_reduced(full, p, whole);
      grad.copy_(whole);
      return;
    }
    const Shape& strides = grad.strides();
    const std::vector<int64_t> at = batch_offsets(p.batch_shape, lead, Shape(strides.begin(), strides.end() - 2));
    const int64_t rows = shape[shape.size() - 2], cols = shape.back(), row = grad.stride(-2);
    dispatch_dtype(grad.dtype(), [&](auto tag) {
      using T = decltype(tag);
      if constexpr (!std::is_same_v<T, bool> && !std::is_same_v<T, int64_t>) {
        T* dst = grad.data<T>();
#pragma omp parallel for schedule(static) if (int64_t(at.size()) * rows * cols >= (int64_t(1) << 16))
        for (int64_t r = 0; r < int64_t(at.size()) * rows; ++r) {
          T* out = dst + at[size_t(r / rows)] + r % rows * row;
          if constexpr (std::is_same_v<T, bfloat16> && std::is_same_v<A, float>) {
            round_to_bf16_here(full + r * cols, out, cols);  // vectorised (bf16-mixed's q, k, v gradients)
          } else {
            for (int64_t x = 0; x < cols; ++x) out[x] = store_as<T>(full[r * cols + x]);
          }
        }
      }
    });
    return;
  }
  const int64_t inner = shape[shape.size() - 2] * shape[shape.size() - 1];
  const Shape strides = contiguous_strides(shape);
  const std::vector<int64_t> offset = batch_offsets(p.batch_shape, lead, Shape(strides.begin(), strides.end() - 2));
  bool in_order = int64_t(offset.size()) * inner == grad.numel();
  for (size_t b = 0; in_order && b < offset.size(); ++b) in_order = offset[b] == int64_t(b) * inner;
  if (in_order) {
    dispatch_dtype(grad.dtype(), [&](auto tag) {
      using T = decltype(tag);
      if constexpr (std::is_same_v<T, bfloat16> && std::is_same_v<A, float>) {
        round_to_bf16(full, grad.data<T>(), grad.numel());  // (T, not bfloat16: clang checks the call when A is double otherwise)
      } else if constexpr (!std::is_same_v<T, bool> && !std::is_same_v<T, int64_t>) {
        T* dst = grad.data<T>();
        const int64_t n = grad.numel();
#pragma omp parallel for schedule(static) if (n >= (int64_t(1) << 16))
        for (int64_t x = 0; x < n; ++x) dst[x] = store_as<T>(full[x]);
      }
    });
    return;
  }
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

template <class A>
void store_reduced(const std::vector<A>& full, const AttentionParams& p, Tensor& grad) {
  store_reduced(full.data(), p, grad);
}

}  // namespace mha::cpu
