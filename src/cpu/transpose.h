// 4 × 4 blocks of float32 transposed in SSE registers (baseline x86-64), for
// the copies that read rows and write columns: the attention's query tiles
// (flash/float_operands.cpp), a transposed B packed into panels and C plus a
// product's transpose (cpu/sgemm, cpu/gemm.cpp). Element by element such a
// copy takes one load and one store per float, each load on another row's
// line; by blocks it takes four loads, eight shuffles and four stores per
// sixteen.
#pragma once

#include <cstdint>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace mha::cpu {

// All always inlined: each instruction set's kernels include this file, and
// an out-of-line copy built for one of them (say with AVX-512 encodings) may
// be the one the linker keeps for all.

// dst[c·dst_row + r] = src[r·src_row + c] (kAdd: +=), one element.
template <bool kAdd>
[[gnu::always_inline]] inline void transpose_one(const float* src, int64_t src_row, float* dst, int64_t dst_row,
                                                 int64_t r, int64_t c) {
  float& out = dst[c * dst_row + r];
  out = kAdd ? out + src[r * src_row + c] : src[r * src_row + c];
}

// transpose_one for r, c < 4.
template <bool kAdd = false>
[[gnu::always_inline]] inline void transpose4x4(const float* src, int64_t src_row, float* dst, int64_t dst_row) {
#if defined(__SSE__)
  __m128 a = _mm_loadu_ps(src), b = _mm_loadu_ps(src + src_row);
  __m128 c = _mm_loadu_ps(src + 2 * src_row), d = _mm_loadu_ps(src + 3 * src_row);
  _MM_TRANSPOSE4_PS(a, b, c, d);
  const __m128 rows[4] = {a, b, c, d};
  for (int i = 0; i < 4; ++i) {
    float* out = dst + i * dst_row;
    _mm_storeu_ps(out, kAdd ? _mm_add_ps(_mm_loadu_ps(out), rows[i]) : rows[i]);
  }
#else
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t c = 0; c < 4; ++c) transpose_one<kAdd>(src, src_row, dst, dst_row, r, c);
#endif
}

// transpose_one for r < rows, c < cols: whole 4 × 4 blocks by transpose4x4,
// the edges element by element.
template <bool kAdd = false>
[[gnu::always_inline]] inline void transpose_block(const float* src, int64_t src_row, int64_t rows, int64_t cols,
                                                   float* dst, int64_t dst_row) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    int64_t c = 0;
    for (; c + 4 <= cols; c += 4) transpose4x4<kAdd>(src + r * src_row + c, src_row, dst + c * dst_row + r, dst_row);
    for (; c < cols; ++c)
      for (int64_t i = r; i < r + 4; ++i) transpose_one<kAdd>(src, src_row, dst, dst_row, i, c);
  }
  for (; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) transpose_one<kAdd>(src, src_row, dst, dst_row, r, c);
}

}  // namespace mha::cpu
