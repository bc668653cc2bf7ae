// sums16: the sums of sixteen 512-bit vectors' lanes in one vector (AVX-512
// builds only), for dot products that end in a sum across lanes, such as the
// skinny products' tiles (cpu/skinny.h).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include "cpu/simd/unroll.h"

namespace mha::cpu {

// The sums of sixteen vectors' lanes in one vector, added as a tree: halves
// of a pair side by side (8 vectors), then quarters (4), pairs of lanes (2)
// and lanes (1), two shuffles and an add a step, 45 instructions where
// sixteen reductions of one vector take eight each. Lane 4l + e holds a[4e +
// l]'s sum (the order of a 4 × 4 transpose): a[q] = x[4·(q mod 4) + q / 4]
// puts x[i]'s sum in lane i. Each sum adds its lanes in the order
// _mm512_reduce_add_ps does (halves, quarters, pairs, then the two left).
[[gnu::always_inline]] inline __m512 sums16(const __m512 (&a)[16]) {
  __m512 s[8], t[4];
  // s[i]: 128-bit lanes 0 and 1 a[2i]'s halves added, 2 and 3 a[2i + 1]'s.
  MHA_UNROLL for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  // t[i]: 128-bit lane l four partial sums of a[4i + l].
  MHA_UNROLL for (int i = 0; i < 4; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  // u[h], lane l: two partial sums each of a[8h + l] and a[8h + 4 + l], interleaved.
  const __m512 u0 = _mm512_add_ps(_mm512_unpacklo_ps(t[0], t[1]), _mm512_unpackhi_ps(t[0], t[1]));
  const __m512 u1 = _mm512_add_ps(_mm512_unpacklo_ps(t[2], t[3]), _mm512_unpackhi_ps(t[2], t[3]));
  // Lane l, element e: a[4e + l] whole, at position 4l + e.
  return _mm512_add_ps(_mm512_shuffle_ps(u0, u1, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(u0, u1, _MM_SHUFFLE(3, 2, 3, 2)));
}

}  // namespace mha::cpu
#endif
