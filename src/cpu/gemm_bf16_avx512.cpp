// The bfloat16 matrix product on AVX512-BF16 (vdpbf16ps), with the fused
// attention kernels' bfloat16 micro-tiles (cpu/flash/kernel.h, gemm_bf16):
//
//   op(A) as pairs along k, one 32-bit word per pair, (m, ceil(k/2)) words:
//         read in place when A is not transposed, k is even and its rows
//         are word-aligned; else packed, (ceil(k/2), m) for a transposed A
//         (a contiguous copy), with a zero pad for an odd k
//   op(B) as pairs along k for each column, (ceil(k/2), n_pad) words, n_pad
//         a multiple of 16 (zero pad): always packed
//   C     tiles of (kRows × kCols) computed into a float scratch of the
//         thread, then C = alpha·tile + beta·C (C is not read when beta = 0)
//
// vdpbf16ps adds both products of a pair into a float32 lane; it treats
// bfloat16 denormals (|x| < 1.2e-38) as zero and flushes denormal results.
#define MHA_SIMD_AVX512 1
#define MHA_ISA_NAMESPACE avx512
#include <omp.h>

#include <algorithm>
#include <vector>

#include "cpu/flash/kernel.h"
#include "cpu/gemm.h"

namespace mha::cpu {

namespace {

// Tile of C per work item: 32 rows (4 micro-tiles) by 128 columns (4 panels
// of 32), so that a product of a few dozen rows still spreads over threads
// and a B panel of 32 columns is reused by every row of the tile.
constexpr int64_t kRows = 32, kCols = 128;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// (lo | hi << 16): the pair (lo, hi) as one 32-bit word, lo first in memory.
inline uint32_t pair(const bfloat16& lo, const bfloat16& hi) { return uint32_t(lo.bits) | uint32_t(hi.bits) << 16; }

std::vector<uint32_t>& scratch_words(int slot, int64_t size) {
  thread_local std::vector<uint32_t> words[2];
  if (words[slot].size() < size_t(size)) words[slot].resize(size_t(size));
  return words[slot];
}

// The pairs of the k rows (x_row(0), …, x_row(k-1)) of `count` elements each
// (rows `ld` apart): out[p·ldo + i] = (row 2p, row 2p+1) at element i, a zero
// second half for an odd k; elements count … pad−1 are 0.
void pack_row_pairs(const bfloat16* x, int64_t ld, int64_t k, int64_t count, int64_t pad, uint32_t* out,
                    int64_t ldo) {
  const bfloat16 zero;
#pragma omp parallel for schedule(static) if ((k / 2) * count > (int64_t(1) << 16))
  for (int64_t p = 0; p < (k + 1) / 2; ++p) {
    const bfloat16* lo = x + 2 * p * ld;
    const bfloat16* hi = 2 * p + 1 < k ? lo + ld : nullptr;
    uint32_t* o = out + p * ldo;
    for (int64_t i = 0; i < count; ++i) o[i] = pair(lo[i], hi ? hi[i] : zero);
    for (int64_t i = count; i < pad; ++i) o[i] = 0;
  }
}

// The pairs along each row of x (count rows of k elements, `ld` apart) as
// words: out[r·ldr + p·ldp] = (x[r][2p], x[r][2p+1]); rows count … pad−1 are 0.
void pack_column_pairs(const bfloat16* x, int64_t ld, int64_t k, int64_t count, int64_t pad, uint32_t* out,
                       int64_t ldr, int64_t ldp) {
  const bfloat16 zero;
  const int64_t K2 = (k + 1) / 2;
  for (int64_t r = 0; r < pad; ++r)
    for (int64_t p = 0; p < K2; ++p)
      out[r * ldr + p * ldp] = r < count ? pair(x[r * ld + 2 * p], 2 * p + 1 < k ? x[r * ld + 2 * p + 1] : zero) : 0;
}

std::vector<float>& scratch_tile() {
  thread_local std::vector<float> tile(size_t(kRows * kCols));
  return tile;
}

}  // namespace

void gemm_bf16_avx512(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const bfloat16* a,
                      int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const int64_t K2 = (k + 1) / 2, n_pad = round_up(n, avx512::W);
  // op(A) (m × k) as words A2[r·ar + p·ak]: in place, or packed.
  const uint32_t* a2 = reinterpret_cast<const uint32_t*>(a);
  int64_t ar = lda / 2, ak = 1;
  if (ta) {  // A is k × m: pairs of rows, (K2, m)
    uint32_t* packed = scratch_words(0, K2 * m).data();
    pack_row_pairs(a, lda, k, m, m, packed, m);
    a2 = packed, ar = 1, ak = m;
  } else if (k % 2 != 0 || lda % 2 != 0 || reinterpret_cast<uintptr_t>(a) % 4 != 0) {
    uint32_t* packed = scratch_words(0, m * K2).data();
    pack_column_pairs(a, lda, k, m, m, packed, K2, 1);
    a2 = packed, ar = K2;
  }
  // op(B) (k × n) as (K2, n_pad) words: B itself is k × n, or n × k when transposed.
  uint32_t* b2 = scratch_words(1, K2 * n_pad).data();
  if (tb) pack_column_pairs(b, ldb, k, n, n_pad, b2, 1, n_pad);
  else pack_row_pairs(b, ldb, k, n, n_pad, b2, n_pad);

  const int64_t row_tiles = (m + kRows - 1) / kRows, col_tiles = (n_pad + kCols - 1) / kCols;
#pragma omp parallel for schedule(dynamic, 1) if (m * n * k > (int64_t(1) << 18))
  for (int64_t item = 0; item < row_tiles * col_tiles; ++item) {
    const int64_t r0 = item / col_tiles * kRows, c0 = item % col_tiles * kCols;
    const int64_t rows = std::min(kRows, m - r0), cols = std::min(kCols, n_pad - c0), width = std::min(cols, n - c0);
    float* tile = scratch_tile().data();
    avx512::gemm_bf16<false>(rows, cols, K2, a2 + r0 * ar, ar, ak, reinterpret_cast<const uint16_t*>(b2 + c0),
                             2 * n_pad, tile, kCols);
    for (int64_t r = 0; r < rows; ++r) {
      float* out = c + (r0 + r) * ldc + c0;
      const float* t = tile + r * kCols;
      if (beta == 0.0f)
        for (int64_t j = 0; j < width; ++j) out[j] = alpha * t[j];
      else
        for (int64_t j = 0; j < width; ++j) out[j] = alpha * t[j] + beta * out[j];
    }
  }
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
