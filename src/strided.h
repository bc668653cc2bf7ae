// Row-major walks over strided index spaces.
#pragma once

#include <cstdint>
#include <vector>

namespace mha {

// Like for_each_offset over two tensors of the same shape: f(offset_a, offset_b).
template <class F>
void for_each_offset2(const std::vector<int64_t>& shape, const std::vector<int64_t>& sa,
                      const std::vector<int64_t>& sb, F&& f) {
  const size_t rank = shape.size();
  for (int64_t n : shape)
    if (n == 0) return;
  if (rank == 0) return f(int64_t(0), int64_t(0));
  std::vector<int64_t> index(rank, 0);
  const int64_t inner = shape[rank - 1], ia = sa[rank - 1], ib = sb[rank - 1];
  int64_t a = 0, b = 0;
  while (true) {
    for (int64_t i = 0; i < inner; ++i) f(a + i * ia, b + i * ib);
    size_t d = rank - 1;
    while (true) {
      if (d == 0) return;
      --d;
      a += sa[d];
      b += sb[d];
      if (++index[d] < shape[d]) break;
      a -= sa[d] * shape[d];
      b -= sb[d] * shape[d];
      index[d] = 0;
    }
  }
}

// Calls f(offset) for every index of `shape` in row-major order.
template <class F>
void for_each_offset(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, F&& f) {
  for_each_offset2(shape, strides, strides, [&](int64_t a, int64_t) { f(a); });
}

}  // namespace mha
