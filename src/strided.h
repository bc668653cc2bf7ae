// Row-major walks over strided index spaces.
#pragma once

#include <omp.h>

#include <cstdint>
#include <vector>

namespace mha {

// The rows (last dimension) of two tensors of the same shape:
// f(row_offset_a, row_offset_b, length, stride_a, stride_b) for every index
// of the leading dimensions, those rows split over OpenMP's threads when
// there are at least `parallel_from` elements (each row by one thread, so f
// must not write what another row reads).
template <class F>
void for_each_row2(const std::vector<int64_t>& shape, const std::vector<int64_t>& sa, const std::vector<int64_t>& sb,
                   int64_t parallel_from, F&& f) {
  const size_t rank = shape.size();
  for (int64_t n : shape)
    if (n == 0) return;
  if (rank == 0) return f(int64_t(0), int64_t(0), int64_t(1), int64_t(1), int64_t(1));
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < rank; ++d) rows *= shape[d];
  const int64_t inner = shape[rank - 1];
  const bool threaded = rows * inner >= parallel_from && rows > 1;
  // Each thread's index, taken before the region (an allocation that fails
  // inside one would end the process).
  std::vector<int64_t> indices(size_t(threaded ? omp_get_max_threads() : 1) * rank, 0);
#pragma omp parallel if (threaded)
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = rows * t / threads, last = rows * (t + 1) / threads;
    // The index of row `first`, then an odometer over the leading dimensions.
    int64_t* index = indices.data() + size_t(t) * rank;
    int64_t a = 0, b = 0;
    for (int64_t rest = first, d = int64_t(rank) - 2; d >= 0; --d) {
      index[d] = rest % shape[size_t(d)];
      rest /= shape[size_t(d)];
      a += index[d] * sa[size_t(d)], b += index[d] * sb[size_t(d)];
    }
    for (int64_t r = first; r < last; ++r) {
      f(a, b, inner, sa[rank - 1], sb[rank - 1]);
      for (int64_t d = int64_t(rank) - 2; d >= 0; --d) {
        const size_t u = size_t(d);
        a += sa[u], b += sb[u];
        if (++index[u] < shape[u]) break;
        a -= sa[u] * shape[u], b -= sb[u] * shape[u];
        index[u] = 0;
      }
    }
  }
}

// Like for_each_offset over two tensors of the same shape: f(offset_a, offset_b).
template <class F>
void for_each_offset2(const std::vector<int64_t>& shape, const std::vector<int64_t>& sa,
                      const std::vector<int64_t>& sb, F&& f) {
  for_each_row2(shape, sa, sb, INT64_MAX, [&](int64_t a, int64_t b, int64_t n, int64_t ia, int64_t ib) {
    for (int64_t i = 0; i < n; ++i) f(a + i * ia, b + i * ib);
  });
}

// Calls f(offset) for every index of `shape` in row-major order.
template <class F>
void for_each_offset(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, F&& f) {
  for_each_offset2(shape, strides, strides, [&](int64_t a, int64_t) { f(a); });
}

}  // namespace mha
