// The bfloat16 matrix product on AVX512-BF16 (vdpbf16ps), blocked as
// mha's float32 product (cpu/sgemm/sgemm_kernel.h) with pairs along k:
//
//   op(B) (k × n) packed into panels of 32 columns, each ceil(k/2) rows of
//         32 words, word (q, j) = the pair (B[2q][j], B[2q+1][j]) (zero pad
//         for an odd k and past n)
//   op(A) each tile's rows × kDepth2 pairs packed k-major, kRowsMicro words
//         per pair index: word (q, i) = (A[i][2q], A[i][2q+1])
//   C     tiles of up to 96 × 512 summed over blocks of kDepth2 pairs, straight
//         into C for alpha = 1 and beta 0 or 1 (the layers' products), else
//         into a float32 product that is then scaled into C
//
// A panel's kDepth2 × 32 words (24 KiB) stay in L1 while the tile's 12-row
// micro-tiles pass over them: 24 accumulators, 2 loads of B per 24 vdpbf16ps
// (each 32 products). vdpbf16ps adds both products of a pair into a float32
// lane; it treats bfloat16 denormals (|x| < 1.2e-38) as zero and flushes
// denormal results.
#include <immintrin.h>
#include <omp.h>

#include <cstdlib>
#include <new>

#include "cpu/gemm.h"
#include "cpu/scratch.h"

namespace mha::cpu {

namespace {

constexpr int kRowsMicro = 12, kVectors = 2, kLanes = 16;
constexpr int64_t kPanel = kVectors * kLanes;  // columns of a B panel
constexpr int64_t kRows = 96, kCols = 512, kDepth2 = 192;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// (lo | hi << 16): the pair (lo, hi) as one 32-bit word, lo first in memory.
inline uint32_t pair(uint16_t lo, uint16_t hi) { return uint32_t(lo) | uint32_t(hi) << 16; }

// C (kRowsMicro × kPanel, row stride ldc) (+)= A · P over `depth` pairs.
template <bool ACC>
void micro(const uint32_t* A, const uint32_t* P, float* C, int64_t ldc, int64_t depth) {
  __m512 acc[kRowsMicro][kVectors];
  for (int r = 0; r < kRowsMicro; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = ACC ? _mm512_loadu_ps(C + r * ldc + v * kLanes) : _mm512_setzero_ps();
  for (int64_t q = 0; q < depth; ++q, A += kRowsMicro, P += kPanel) {
    __m512bh b[kVectors];
    for (int v = 0; v < kVectors; ++v) b[v] = (__m512bh)_mm512_loadu_si512(P + v * kLanes);
    for (int r = 0; r < kRowsMicro; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int(A[r]));
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < kRowsMicro; ++r)
    for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(C + r * ldc + v * kLanes, acc[r][v]);
}

// C rows [0, rows) × columns [0, width) (+)= packed A rows · panel P; full
// micro-tiles straight into C, the edges through a tile on the stack.
void panel_into(bool accumulate, int64_t rows, int64_t width, int64_t depth, const uint32_t* packed_rows,
                const uint32_t* P, float* C, int64_t ldc) {
  for (int64_t r = 0; r < rows; r += kRowsMicro) {
    const uint32_t* a = packed_rows + r * depth;
    const int64_t here = min64(kRowsMicro, rows - r);
    float* out = C + r * ldc;
    if (here == kRowsMicro && width == kPanel) {
      accumulate ? micro<true>(a, P, out, ldc, depth) : micro<false>(a, P, out, ldc, depth);
      continue;
    }
    alignas(64) float edge[kRowsMicro * kPanel];
    if (accumulate)
      for (int64_t i = 0; i < kRowsMicro; ++i)
        for (int64_t j = 0; j < kPanel; ++j) edge[i * kPanel + j] = i < here && j < width ? out[i * ldc + j] : 0.0f;
    accumulate ? micro<true>(a, P, edge, kPanel, depth) : micro<false>(a, P, edge, kPanel, depth);
    for (int64_t i = 0; i < here; ++i)
      for (int64_t j = 0; j < width; ++j) out[i * ldc + j] = edge[i * kPanel + j];
  }
}

// C = op(A)·op(B) (beta 0) or C += op(A)·op(B) (beta 1).
void product(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const bfloat16* a, int64_t lda, const bfloat16* b,
             int64_t ldb, bool accumulate, float* c, int64_t ldc) {
  const int64_t K2 = (k + 1) / 2, panels = (n + kPanel - 1) / kPanel, n_pad = panels * kPanel;
  const uint16_t* bb = &b->bits;
  const uint16_t* ab = &a->bits;
  auto b_at = [&](int64_t kk, int64_t j) -> uint16_t { return kk < k ? (tb ? bb[j * ldb + kk] : bb[kk * ldb + j]) : 0; };
  auto a_at = [&](int64_t r, int64_t kk) -> uint16_t { return kk < k ? (ta ? ab[kk * lda + r] : ab[r * lda + kk]) : 0; };
  uint32_t* packed = static_cast<uint32_t*>(thread_scratch_bytes(ScratchSlot::bgemm_b, K2 * n_pad * int64_t(sizeof(uint32_t))));
#pragma omp parallel for schedule(static) if (K2 * n_pad > (int64_t(1) << 15))
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t j0 = p * kPanel, width = min64(kPanel, n - j0);
    for (int64_t q = 0; q < K2; ++q) {
      uint32_t* row = packed + (p * K2 + q) * kPanel;
      for (int64_t j = 0; j < width; ++j) row[j] = pair(b_at(2 * q, j0 + j), b_at(2 * q + 1, j0 + j));
      for (int64_t j = width; j < kPanel; ++j) row[j] = 0;
    }
  }
  const bool threaded = m * n * k > (int64_t(1) << 17);
  const int64_t want = threaded ? 2 * int64_t(omp_get_max_threads()) : 1;
  int64_t tile_rows = kRows, tile_cols = kCols;
  auto items = [&] { return ((m + tile_rows - 1) / tile_rows) * ((n_pad + tile_cols - 1) / tile_cols); };
  while (items() < want && tile_cols > kPanel) tile_cols /= 2;
  while (items() < want && tile_rows > kRowsMicro) tile_rows = round_up(tile_rows / 2, kRowsMicro);
  const int64_t row_tiles = (m + tile_rows - 1) / tile_rows, col_tiles = (n_pad + tile_cols - 1) / tile_cols;
  // Each thread's packed rows of A, taken before the region (parallel.h).
  const PerThread row_buffers = per_thread_scratch(ScratchSlot::bgemm_rows, kRows * kDepth2 * int64_t(sizeof(uint32_t)));
#pragma omp parallel for schedule(dynamic, 1) if (threaded && row_tiles * col_tiles > 1)
  for (int64_t item = 0; item < row_tiles * col_tiles; ++item) {
    const int64_t r0 = item / col_tiles * tile_rows, c0 = item % col_tiles * tile_cols;
    const int64_t rows = min64(tile_rows, m - r0), cols = min64(tile_cols, n_pad - c0);
    const int64_t padded = round_up(rows, kRowsMicro);
    uint32_t* rows_packed = static_cast<uint32_t*>(own_slice(row_buffers));
    for (int64_t q0 = 0; q0 < K2; q0 += kDepth2) {
      const int64_t depth = min64(kDepth2, K2 - q0);
      for (int64_t g = 0; g < padded; g += kRowsMicro)
        for (int64_t q = 0; q < depth; ++q) {
          uint32_t* w = rows_packed + g * depth + q * kRowsMicro;
          const int64_t kk = 2 * (q0 + q);
          for (int64_t i = 0; i < kRowsMicro; ++i) {
            const int64_t r = r0 + g + i;
            w[i] = r < m ? pair(a_at(r, kk), a_at(r, kk + 1)) : 0;
          }
        }
      for (int64_t j = 0; j < cols; j += kPanel)
        panel_into(q0 > 0 || accumulate, rows, min64(kPanel, n - c0 - j), depth, rows_packed,
                   packed + ((c0 + j) / kPanel * K2 + q0) * kPanel, c + r0 * ldc + c0 + j, ldc);
    }
  }
}

}  // namespace

void gemm_bf16_avx512(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const bfloat16* a,
                      int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k == 0) {
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n; ++j) c[r * ldc + j] = beta == 0.0f ? 0.0f : beta * c[r * ldc + j];
    return;
  }
  if (alpha == 1.0f && (beta == 0.0f || beta == 1.0f)) return product(ta, tb, m, n, k, a, lda, b, ldb, beta == 1.0f, c, ldc);
  // Other scalings: the product apart, then C = alpha·product + beta·C (C not read for beta = 0).
  float* t = static_cast<float*>(std::aligned_alloc(64, size_t(round_up(m * n, 16)) * sizeof(float)));
  if (!t) throw std::bad_alloc();
  product(ta, tb, m, n, k, a, lda, b, ldb, false, t, n);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j)
      c[r * ldc + j] = beta == 0.0f ? alpha * t[r * n + j] : alpha * t[r * n + j] + beta * c[r * ldc + j];
  std::free(t);
}

void round_to_bf16_avx512(const float* src, bfloat16* dst, int64_t n) {
  // bfloat16::round_from on 16 lanes: add 0x7fff plus the lowest kept bit,
  // keep the top half; NaN keeps its top half with the quiet bit set.
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff), quiet = _mm512_set1_epi32(0x40);
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), infinity = _mm512_set1_epi32(0x7f800000);
  const int64_t vectors = n / 16;
#pragma omp parallel for schedule(static) if (n > (int64_t(1) << 18))
  for (int64_t v = 0; v < vectors; ++v) {
    const __m512i u = _mm512_loadu_si512(src + 16 * v);
    const __m512i top = _mm512_srli_epi32(u, 16);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(top, one))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, magnitude), infinity);
    const __m512i bits = _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(top, quiet));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * v), _mm512_cvtepi32_epi16(bits));
  }
  for (int64_t i = 16 * vectors; i < n; ++i) dst[i] = bfloat16(src[i]);
}

}  // namespace mha::cpu
