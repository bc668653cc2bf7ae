// The bfloat16 matrix product on AVX512-BF16 (vdpbf16ps), blocked as
// mha's float32 product (cpu/sgemm/sgemm_kernel.h) with pairs along k:
//
//   op(B) (k × n) packed into panels of 64 columns, each ceil(k/2) rows of
//         64 words, word (q, j) = the pair (B[2q][j], B[2q+1][j]) (zero pad
//         for an odd k and past n)
//   op(A) each tile's rows × kDepth2 pairs packed k-major, kRowsMicro words
//         per pair index: word (q, i) = (A[i][2q], A[i][2q+1])
//   C     tiles of up to kRows rows and the whole width of C (fewer columns
//         only where there are fewer row groups than threads), summed over
//         blocks of kDepth2 pairs, straight into C for alpha = 1 and beta 0
//         or 1 (the layers' products), else into a float32 product that is
//         then scaled into C
//
// A panel's kDepth2 × 64 words (32 KiB) stay in L1 while the tile's 6-row
// micro-tiles pass over them: 24 accumulators, 4 loads of B and 6
// broadcasts of A per 24 vdpbf16ps (each 32 products). Against 12 rows × 2
// vectors (2 loads and 12 broadcasts per 24) one core ran 4072 × 2048 × 512
// at 394 against 371 GFLOP/s (Zen 5; 447 peak). A tile spans all of C's
// columns, so that its rows of A are packed once per block of k: 512-column
// tiles packed them once per tile, 4 times over for n = 2048, and the
// packing (its loads waiting on A's lines) took 6% of a bf16-mixed training
// step at wide. Tiles have as many rows as keep the threads evenly busy, up
// to kRows: each block of B comes from L3 once per tile. vdpbf16ps adds both
// products of a pair into a float32 lane; it treats bfloat16 denormals
// (|x| < 1.2e-38) as zero and flushes denormal results.
#include <immintrin.h>
#include <omp.h>

#include <cstring>

#include "cpu/gemm.h"
#include "cpu/gemm_bf16_scaled.h"
#include "cpu/scratch.h"
#include "cpu/simd/unroll.h"
#include "cpu/skinny.h"

namespace mha::cpu {

namespace {

constexpr int kRowsMicro = 6, kVectors = 4, kLanes = 16;
constexpr int64_t kPanel = kVectors * kLanes;  // columns of a B panel
constexpr int64_t kRows = 192, kCols = 512, kDepth2 = 128, kSpan2 = 2048;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// C (kRowsMicro × kPanel, row stride ldc) (+)= A · P over `depth` pairs.
// The sums start from zero and C is added at the end, its lines prefetched
// as the loop starts (sgemm_kernel.h: C, not in cache between blocks of k,
// held up each micro-tile that loaded it first). Without ACC, bias (kPanel
// columns) when not null is added instead: C = A · P + bias, the same bits
// as C filled with the bias and then accumulated into, without that pass.
template <bool ACC>
void micro(const uint32_t* A, const uint32_t* P, float* C, int64_t ldc, int64_t depth, const float* bias = nullptr) {
  __m512 acc[kRowsMicro][kVectors];
  MHA_UNROLL for (int r = 0; r < kRowsMicro; ++r)
    MHA_UNROLL for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  if (ACC)
    MHA_UNROLL for (int r = 0; r < kRowsMicro; ++r)
      MHA_UNROLL for (int v = 0; v < kVectors; ++v) _mm_prefetch(reinterpret_cast<const char*>(C + r * ldc + v * kLanes), _MM_HINT_T0);
  for (int64_t q = 0; q < depth; ++q, A += kRowsMicro, P += kPanel) {
    __m512bh b[kVectors];
    MHA_UNROLL for (int v = 0; v < kVectors; ++v) b[v] = (__m512bh)_mm512_loadu_si512(P + v * kLanes);
    MHA_UNROLL for (int r = 0; r < kRowsMicro; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int(A[r]));
      MHA_UNROLL for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  MHA_UNROLL for (int r = 0; r < kRowsMicro; ++r)
    MHA_UNROLL for (int v = 0; v < kVectors; ++v) {
      float* out = C + r * ldc + v * kLanes;
      if (ACC) _mm512_storeu_ps(out, _mm512_add_ps(acc[r][v], _mm512_loadu_ps(out)));
      else _mm512_storeu_ps(out, bias ? _mm512_add_ps(acc[r][v], _mm512_loadu_ps(bias + v * kLanes)) : acc[r][v]);
    }
}

// C rows [0, rows) × columns [0, width) (+)= packed A rows · panel P (+ bias,
// its width columns, when not accumulating); full micro-tiles straight into
// C, the edges through a tile on the stack.
void panel_into(bool accumulate, int64_t rows, int64_t width, int64_t depth, const uint32_t* packed_rows,
                const uint32_t* P, float* C, int64_t ldc, const float* bias) {
  for (int64_t r = 0; r < rows; r += kRowsMicro) {
    const uint32_t* a = packed_rows + r * depth;
    const int64_t here = min64(kRowsMicro, rows - r);
    float* out = C + r * ldc;
    if (here == kRowsMicro && width == kPanel) {
      accumulate ? micro<true>(a, P, out, ldc, depth) : micro<false>(a, P, out, ldc, depth, bias);
      continue;
    }
    alignas(64) float edge[kRowsMicro * kPanel];
    const bool add = accumulate || bias;  // the edge starts as C's part, or the bias in each row
    if (add)
      for (int64_t i = 0; i < kRowsMicro; ++i)
        for (int64_t j = 0; j < kPanel; ++j)
          edge[i * kPanel + j] = i >= here || j >= width ? 0.0f : accumulate ? out[i * ldc + j] : bias[j];
    add ? micro<true>(a, P, edge, kPanel, depth) : micro<false>(a, P, edge, kPanel, depth);
    for (int64_t i = 0; i < here; ++i)
      for (int64_t j = 0; j < width; ++j) out[i * ldc + j] = edge[i * kPanel + j];
  }
}

// The pair of elements (kk, kk + 1) of a row along k, as one word: a 32-bit
// load where both lie inside k, else the first alone (or 0).
inline uint32_t row_pair(const uint16_t* row, int64_t kk, int64_t k) {
  if (kk + 1 < k) {
    uint32_t w;
    std::memcpy(&w, row + kk, 4);
    return w;
  }
  return kk < k ? row[kk] : 0;
}

// op(B) (k × n) into panels (the layout above): B along n (tb false: the
// pairs interleave rows 2q and 2q + 1) or along k (tb true: each column's
// pairs are 32-bit words of its row).
void pack_b(bool tb, const uint16_t* b, int64_t ldb, int64_t k, int64_t n, uint32_t* packed) {
  const int64_t K2 = (k + 1) / 2, panels = (n + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static) if (K2 * panels * kPanel > (int64_t(1) << 15))
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t j0 = p * kPanel, width = min64(kPanel, n - j0);
    uint32_t* panel = packed + p * K2 * kPanel;
    if (tb) {
      for (int64_t j = 0; j < width; ++j)
        for (int64_t q = 0; q < K2; ++q) panel[q * kPanel + j] = row_pair(b + (j0 + j) * ldb, 2 * q, k);
      for (int64_t q = 0; q < K2; ++q)
        for (int64_t j = width; j < kPanel; ++j) panel[q * kPanel + j] = 0;
      continue;
    }
    for (int64_t q = 0; q < K2; ++q) {
      const uint16_t* even = b + 2 * q * ldb + j0;
      interleave_pairs_avx512(even, 2 * q + 1 < k ? even + ldb : nullptr, width, panel + q * kPanel);
      for (int64_t j = width; j < kPanel; ++j) panel[q * kPanel + j] = 0;
    }
  }
}

// Rows [r0, r0 + padded) × pairs [q0, q0 + depth) of op(A) (m × k) packed
// k-major in groups of kRowsMicro rows (the layout above), rows past m 0:
// A along k (ta false: each row's pairs are words of the row) or along m
// (ta true: the pairs interleave rows 2q and 2q + 1 of the stored A).
void pack_a(bool ta, const uint16_t* a, int64_t lda, int64_t m, int64_t k, int64_t r0, int64_t padded, int64_t q0,
            int64_t depth, uint32_t* out) {
  const int64_t rows = min64(padded, m - r0);
  if (ta) {
    // Stored row by stored row, each pair of rows read whole (as vectors)
    // and the next pair prefetched, then dealt to the groups: group by
    // group, every group went down all 2·depth rows, lines apart, again
    // (2048 × 512 × 4072 on 2 threads: 543-545 -> 580-592 GFLOP/s).
    constexpr int64_t kAhead = 2;
    alignas(64) uint32_t line[kRows];
    for (int64_t i = rows; i < padded; ++i) line[i] = 0;
    for (int64_t q = 0; q < depth; ++q) {
      const int64_t kk = 2 * (q0 + q);
      const uint16_t* even = a + kk * lda + r0;
      if (kk + kAhead + 1 < k)
        for (int64_t i = 0; i < rows; i += 32) {
          __builtin_prefetch(even + kAhead * lda + i);
          __builtin_prefetch(even + (kAhead + 1) * lda + i);
        }
      interleave_pairs_avx512(even, kk + 1 < k ? even + lda : nullptr, rows, line);
      for (int64_t g = 0; g < padded; g += kRowsMicro)
        std::memcpy(out + g * depth + q * kRowsMicro, line + g, kRowsMicro * sizeof(uint32_t));
    }
    return;
  }
  for (int64_t g = 0; g < padded; g += kRowsMicro) {
    uint32_t* w = out + g * depth;
    for (int64_t i = 0; i < kRowsMicro; ++i) {
      if (g + i >= rows) {
        for (int64_t q = 0; q < depth; ++q) w[q * kRowsMicro + i] = 0;
        continue;
      }
      const uint16_t* row = a + (r0 + g + i) * lda;
      // Whole pairs as 32-bit loads without a test (whole >= 0: q0 < K2); an odd k's last element alone.
      const int64_t whole = min64(depth, k / 2 - q0);
      for (int64_t q = 0; q < whole; ++q) std::memcpy(w + q * kRowsMicro + i, row + 2 * (q0 + q), 4);
      for (int64_t q = whole; q < depth; ++q) w[q * kRowsMicro + i] = row_pair(row, 2 * (q0 + q), k);
    }
  }
}

// C = op(A)·op(B) (+ bias along the rows, when not null) (beta 0) or
// C += op(A)·op(B) (beta 1, no bias).
void product(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const bfloat16* a, int64_t lda, const bfloat16* b,
             int64_t ldb, bool accumulate, float* c, int64_t ldc, const float* bias = nullptr) {
  const int64_t K2 = (k + 1) / 2, panels = (n + kPanel - 1) / kPanel;
  uint32_t* packed = static_cast<uint32_t*>(thread_scratch_bytes(ScratchSlot::bgemm_b, K2 * panels * kPanel * int64_t(sizeof(uint32_t))));
  pack_b(tb, &b->bits, ldb, k, n, packed);
  // Row tiles: groups of kRowsMicro rows dealt evenly, a multiple of the
  // threads in number, at most kRows rows each; column tiles (panels dealt
  // evenly) only where the groups are fewer than the threads.
  const bool threaded = m * n * k > (int64_t(1) << 17);
  const int64_t threads = threaded ? int64_t(omp_get_max_threads()) : 1, groups = (m + kRowsMicro - 1) / kRowsMicro;
  const int64_t row_tiles = min64(groups, round_up((groups + kRows / kRowsMicro - 1) / (kRows / kRowsMicro), threads));
  const int64_t col_tiles = min64(panels, (threads + row_tiles - 1) / row_tiles);
  const int64_t span2 = min64(K2, kSpan2);
  // Each thread's packed rows of A, taken before the region (parallel.h).
  const PerThread row_buffers = per_thread_scratch(ScratchSlot::bgemm_rows, kRows * span2 * int64_t(sizeof(uint32_t)));
  // The equal tiles in equal shares (static): each thread the same rows of
  // C every call. Alternating call by call with a dynamic hand-out in one
  // process (Zen 5, 2 threads, two runs): weight gradients 2048 × 512 ×
  // 4072 +2.2/+2.7%, 1024 × 256 × 2096 +2.8%, 512 × 512 × 4072 +1.3/+2.2%,
  // the forward products within ±1%.
#pragma omp parallel for schedule(static) if (threaded && row_tiles * col_tiles > 1)
  for (int64_t item = 0; item < row_tiles * col_tiles; ++item) {
    const int64_t i = item / col_tiles, j = item % col_tiles;
    const int64_t r0 = i * groups / row_tiles * kRowsMicro, r1 = min64(m, (i + 1) * groups / row_tiles * kRowsMicro);
    const int64_t p0 = j * panels / col_tiles, p1 = (j + 1) * panels / col_tiles, rows = r1 - r0;
    const int64_t padded = round_up(rows, kRowsMicro);
    uint32_t* rows_packed = static_cast<uint32_t*>(own_slice(row_buffers));
    // The tile's rows of A packed once per span of k (kSpan2 pairs) for all
    // its columns, which it takes kCols at a time through every block of
    // the span, so that C's tile (at most 192 × 512 floats) stays in L2;
    // each block is packed as the first columns need it (in L2 as used).
    for (int64_t s0 = 0; s0 < K2; s0 += kSpan2) {
      const int64_t s1 = min64(K2, s0 + kSpan2);
      for (int64_t c0 = p0; c0 < p1; c0 += kCols / kPanel)
        for (int64_t q0 = s0; q0 < s1; q0 += kDepth2) {
          const int64_t depth = min64(kDepth2, s1 - q0);
          uint32_t* block = rows_packed + (q0 - s0) * padded;
          if (c0 == p0) pack_a(ta, &a->bits, lda, m, k, r0, padded, q0, depth, block);
          for (int64_t p = c0; p < min64(p1, c0 + kCols / kPanel); ++p) {
            const bool into = q0 > 0 || accumulate;
            panel_into(into, rows, min64(kPanel, n - p * kPanel), depth, block, packed + (p * K2 + q0) * kPanel,
                       c + r0 * ldc + p * kPanel, ldc, into || !bias ? nullptr : bias + p * kPanel);
          }
        }
    }
  }
}

// A product with few rows against a transposed B (C = op(A)·Wᵀ, W n × k
// along k: a Linear layer's decoding step) by dot products along k
// (cpu/skinny.h), as sgemm_kernel.h's float32 tiles: each W row read once
// for all rows of A, no packing, in SkinnyShape32's tiles. Each step takes
// 32 elements of k (one vector of pairs), the last step masked (zeros add
// nothing).

template <int R, int C>
void skinny_tile(const uint16_t* a, int64_t lda, const uint16_t* w, int64_t ldw, int64_t k, int64_t rows, int64_t cols,
                 float alpha, float beta, float* c, int64_t ldc, const float* bias) {
  __m512 acc[R][C];
  fill_tile(acc, _mm512_setzero_ps());
  const auto ar = tile_operands<R>(a, lda, rows);
  const auto wr = tile_operands<C>(w, ldw, cols);
  const auto step = [&](int64_t kk, auto load) {
    __m512bh av[R], wv[C];
    MHA_UNROLL for (int r = 0; r < R; ++r) av[r] = (__m512bh)load(ar[r] + kk);
    MHA_UNROLL for (int j = 0; j < C; ++j) wv[j] = (__m512bh)load(wr[j] + kk);
    MHA_UNROLL for (int r = 0; r < R; ++r)
      MHA_UNROLL for (int j = 0; j < C; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av[r], wv[j]);
  };
  // Plain loads but for the last step: a masked 16-bit load (vmovdqu16 with
  // a mask) halved the loop's rate on Zen 5, 3.8 against 1.8 ms for a
  // decoding step's products at wide (8 rows, 37.7 MB of bfloat16 weights).
  int64_t kk = 0;
  for (; kk + 2 * kLanes <= k; kk += 2 * kLanes) step(kk, [](const uint16_t* p) { return _mm512_loadu_si512(p); });
  if (kk < k) {
    const __mmask32 lanes = __mmask32((uint64_t(1) << (k - kk)) - 1);
    step(kk, [lanes](const uint16_t* p) { return _mm512_maskz_loadu_epi16(lanes, p); });
  }
  store_dot_tile(acc, [](__m512 v) { return _mm512_reduce_add_ps(v); }, rows, cols, alpha, beta, c, ldc, bias);
}

void skinny_product(int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda, const uint16_t* w,
                    int64_t ldw, float beta, float* c, int64_t ldc, const float* bias) {
  const auto tile = [&](int64_t r0, int64_t j0, auto tile_rows, auto width, int64_t rows, int64_t cols) {
    skinny_tile<decltype(tile_rows)::value, decltype(width)::value>(a + r0 * lda, lda, w + j0 * ldw, ldw, k, rows,
                                                                    cols, alpha, beta, c + r0 * ldc + j0, ldc,
                                                                    bias ? bias + j0 : nullptr);
  };
  over_dot_tiles<SkinnyShape32>(m, n, k, tile);
}

}  // namespace

void interleave_pairs_avx512(const uint16_t* even, const uint16_t* odd, int64_t n, uint32_t* out) {
  // Lanes 2j and 2j + 1 of the result take element j of even (index j) and
  // of odd (index 32 + j: the second operand); the high half starts at 16.
  const __m512i lo_index = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                            37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_index = _mm512_add_epi16(lo_index, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < n; j += 2 * kLanes) {
    const int64_t here = min64(2 * kLanes, n - j);
    const __mmask32 lanes = here == 2 * kLanes ? ~__mmask32(0) : __mmask32((uint64_t(1) << here) - 1);
    const auto load = [&](const uint16_t* p) {  // plain where whole (skinny_tile says why)
      return here == 2 * kLanes ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(lanes, p);
    };
    const __m512i e = load(even + j), o = odd ? load(odd + j) : _mm512_setzero_si512();
    const __m512i lo = _mm512_permutex2var_epi16(e, lo_index, o), hi = _mm512_permutex2var_epi16(e, hi_index, o);
    if (here == 2 * kLanes) {
      _mm512_storeu_si512(out + j, lo);
      _mm512_storeu_si512(out + j + kLanes, hi);
    } else {
      _mm512_mask_storeu_epi32(out + j, __mmask16(here >= kLanes ? 0xffff : (1u << here) - 1), lo);
      if (here > kLanes) _mm512_mask_storeu_epi32(out + j + kLanes, __mmask16((1u << (here - kLanes)) - 1), hi);
    }
  }
}

void gemm_bf16_avx512(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const bfloat16* a,
                      int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c, int64_t ldc,
                      const float* bias) {
  if (m > 0 && n > 0 && k > 0 && !ta && tb && m <= kBf16SkinnyRows)
    return skinny_product(m, n, k, alpha, &a->bits, lda, &b->bits, ldb, beta, c, ldc, bias);
  if (bias) {  // (alpha 1, beta 0, k > 0: gemm.h)
    if (m > 0 && n > 0) product(ta, tb, m, n, k, a, lda, b, ldb, false, c, ldc, bias);
    return;
  }
  bf16_product_scaled(m, n, k, alpha, beta, c, ldc, [&](bool accumulate, float* out, int64_t ld) {
    product(ta, tb, m, n, k, a, lda, b, ldb, accumulate, out, ld);
  });
}

}  // namespace mha::cpu
