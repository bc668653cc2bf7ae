// The bfloat16 matrix product on AMX, the tile unit of Intel's Xeons from
// the 4th generation (Sapphire Rapids) on (cpu/amx.h: the tiles and
// TDPBF16PS):
//
//   op(B) (k × n) packed into panels of 32 columns (two tiles wide) of K2p
//         pair rows, K2p = ceil(k/2) rounded up to a whole tile (16): word
//         (q, j) = (B[2q][j], B[2q+1][j]), zeros past k and n (the panels
//         of gemm_bf16_avx512, padded)
//   op(A) a work item's rows × a chunk of kChunk pairs, tile by tile: tile
//         (r, s) holds rows 16r … 16r+15 and pairs 16s … 16s+15, its rows 64
//         bytes apart (zeros past m and k)
//   C     blocks of 32 × 32: 2 × 2 accumulator tiles, 2 tiles of A and 2 of B
//         for the other four registers
//
// Per step of 32 along k a block loads 4 KiB of tiles for 4 TDPBF16PS. A
// panel's chunk (kChunk pair rows × 128 bytes, 32 KiB) stays in L1 while the
// item's row blocks pass over it; the item's packed A (kItemRows × kChunk
// words, 128 KiB) stays in L2.
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "cpu/amx.h"
#include "cpu/gemm.h"
#include "cpu/gemm_bf16_scaled.h"
#include "cpu/scratch.h"

namespace mha::cpu {

namespace {

constexpr int64_t kTile = kAmxTile;
constexpr int64_t kPanel = 2 * kTile;          // columns of a B panel
constexpr int64_t kTileWords = kTile * kTile;  // 32-bit words of a tile
constexpr int64_t kItemRows = 128, kChunk = 256;  // kChunk: pairs, a multiple of kTile

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Mask of the bfloat16 elements [first, first + 32) that lie below k.
inline __mmask32 below(int64_t first, int64_t k) {
  const int64_t here = k - first;
  return here >= 32 ? ~__mmask32(0) : here <= 0 ? __mmask32(0) : __mmask32((uint64_t(1) << here) - 1);
}

// Words of 16 values along a stored row: (even[i], odd[i]) for i < count
// (odd null: 0 in every high half), 0 past count.
inline __m512i pairs_of(const uint16_t* even, const uint16_t* odd, int64_t count) {
  const __mmask16 lanes = count >= 16 ? __mmask16(0xffff) : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1);
  const __m512i e = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, even));
  if (!odd) return e;
  return _mm512_or_si512(e, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, odd)), 16));
}

// op(B) (k × n) into panels (the layout above). B along n (tb false): pair
// row q interleaves stored rows 2q and 2q + 1. B along k (tb true): word q
// of stored row j is (q, j), so 16 × 16 blocks of words are transposed.
void pack_b(bool tb, const uint16_t* b, int64_t ldb, int64_t k, int64_t n, int64_t K2p, uint32_t* packed) {
  const int64_t K2 = (k + 1) / 2, panels = (n + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static) if (K2p * panels * kPanel > (int64_t(1) << 15))
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t j0 = p * kPanel, width = min64(kPanel, n - j0);
    uint32_t* panel = packed + p * K2p * kPanel;
    if (!tb) {
      for (int64_t q = 0; q < K2; ++q) {
        const uint16_t* even = b + 2 * q * ldb + j0;
        interleave_pairs_avx512(even, 2 * q + 1 < k ? even + ldb : nullptr, width, panel + q * kPanel);
        for (int64_t j = width; j < kPanel; ++j) panel[q * kPanel + j] = 0;
      }
      std::memset(panel + K2 * kPanel, 0, size_t((K2p - K2) * kPanel) * sizeof(uint32_t));
      continue;
    }
    for (int64_t q0 = 0; q0 < K2p; q0 += kTile)
      for (int64_t half = 0; half < kPanel; half += kTile) {
        __m512i r[16];
        for (int64_t j = 0; j < kTile; ++j)
          r[j] = half + j < width ? _mm512_maskz_loadu_epi16(below(2 * q0, k), b + (j0 + half + j) * ldb + 2 * q0)
                                  : _mm512_setzero_si512();
        transpose16(r);
        for (int64_t q = 0; q < kTile; ++q) _mm512_storeu_si512(panel + (q0 + q) * kPanel + half, r[q]);
      }
  }
}

// Rows [r0, r0 + 16·row_tiles) × pairs [q0, q0 + 16·steps) of op(A) (m × k)
// as tiles (the layout above). A along k (ta false): a tile row is 64 bytes
// of a stored row. A along m (ta true): pair q of rows i … i+15 interleaves
// stored rows 2q and 2q + 1, and the 16 × 16 words are transposed.
void pack_a(bool ta, const uint16_t* a, int64_t lda, int64_t m, int64_t k, int64_t r0, int64_t row_tiles, int64_t q0,
            int64_t steps, uint32_t* out) {
  for (int64_t rt = 0; rt < row_tiles; ++rt)
    for (int64_t s = 0; s < steps; ++s) {
      uint32_t* tile = out + (rt * steps + s) * kTileWords;
      const int64_t i0 = r0 + rt * kTile, first = 2 * (q0 + s * kTile);  // first row, first k
      if (!ta) {
        const __mmask32 lanes = below(first, k);
        for (int64_t i = 0; i < kTile; ++i)
          _mm512_storeu_si512(tile + i * kTile, i0 + i < m ? _mm512_maskz_loadu_epi16(lanes, a + (i0 + i) * lda + first)
                                                           : _mm512_setzero_si512());
        continue;
      }
      __m512i r[16];
      for (int64_t q = 0; q < kTile; ++q) {
        const int64_t kk = first + 2 * q;
        r[q] = kk < k ? pairs_of(a + kk * lda + i0, kk + 1 < k ? a + (kk + 1) * lda + i0 : nullptr, m - i0)
                      : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int64_t i = 0; i < kTile; ++i) _mm512_storeu_si512(tile + i * kTile, r[i]);
    }
}

// C = op(A)·op(B) (accumulate false) or C += op(A)·op(B).
void product(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const bfloat16* a, int64_t lda, const bfloat16* b,
             int64_t ldb, bool accumulate, float* c, int64_t ldc) {
  const int64_t K2p = round_up((k + 1) / 2, kTile), panels = (n + kPanel - 1) / kPanel;
  uint32_t* packed = static_cast<uint32_t*>(
      thread_scratch_bytes(ScratchSlot::bgemm_b, K2p * panels * kPanel * int64_t(sizeof(uint32_t))));
  pack_b(tb, &b->bits, ldb, k, n, K2p, packed);
  const bool threaded = m * n * k > (int64_t(1) << 17);
  const int64_t want = threaded ? 2 * int64_t(omp_get_max_threads()) : 1;
  // An item takes every column where there are rows enough for the threads,
  // so that its rows of A are packed once; else columns are split too.
  int64_t item_rows = kItemRows, item_cols = round_up(n, kPanel);
  auto items = [&] { return ((m + item_rows - 1) / item_rows) * ((n + item_cols - 1) / item_cols); };
  while (items() < want && item_cols > kPanel) item_cols = round_up(item_cols / 2, kPanel);
  while (items() < want && item_rows > kPanel) item_rows /= 2;
  const int64_t row_items = (m + item_rows - 1) / item_rows, col_items = (n + item_cols - 1) / item_cols;
  const PerThread row_buffers =
      per_thread_scratch(ScratchSlot::bgemm_rows, kItemRows * kChunk * int64_t(sizeof(uint32_t)));
#pragma omp parallel if (threaded && row_items * col_items > 1)
  {
    amx_configure();
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < row_items * col_items; ++item) {
      const int64_t r0 = item / col_items * item_rows, c0 = item % col_items * item_cols;
      const int64_t rows = min64(item_rows, m - r0), cols = min64(item_cols, n - c0);
      const int64_t row_tiles = (rows + kTile - 1) / kTile;
      uint32_t* rows_packed = static_cast<uint32_t*>(own_slice(row_buffers));
      for (int64_t q0 = 0; q0 < K2p; q0 += kChunk) {
        const int64_t steps = min64(kChunk, K2p - q0) / kTile;
        pack_a(ta, &a->bits, lda, m, k, r0, row_tiles, q0, steps, rows_packed);
        // A's row tiles one after another, each its steps' tiles; B's panel
        // of two column tiles, its pair rows 128 bytes apart.
        const AmxOperand tiles{rows_packed, 64, steps * kTileWords * 4, kTileWords * 4};
        for (int64_t j = 0; j < cols; j += kPanel) {
          const AmxOperand panel{packed + ((c0 + j) / kPanel * K2p + q0) * kPanel, kPanel * 4, kTile * 4,
                                 kTile * kPanel * 4};
          const int64_t width = min64(kPanel, cols - j);
          amx_product(tiles, row_tiles, panel, (width + kTile - 1) / kTile, steps, q0 > 0 || accumulate,
                      c + r0 * ldc + c0 + j, ldc, rows, width);
        }
      }
    }
    _tile_release();
  }
}

// Whether the CPU has AMX-TILE and AMX-BF16, the system saves their state
// (XCR0's XTILECFG and XTILEDATA) and grants this process the tile data
// (Linux asks each process to request it; refused, TDPBF16PS would fault).
bool amx_granted() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  constexpr unsigned kHasAmxBf16 = 1u << 22, kHasAmxTile = 1u << 24;
  if ((edx & (kHasAmxBf16 | kHasAmxTile)) != (kHasAmxBf16 | kHasAmxTile)) return false;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return false;  // OSXSAVE
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  constexpr unsigned kTileState = (1u << 17) | (1u << 18);
  if ((lo & kTileState) != kTileState) return false;
#ifdef SYS_arch_prctl
  constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
#else
  return false;
#endif
}

}  // namespace

bool amx_bf16_usable() {
  static const bool usable = amx_granted() && __builtin_cpu_supports("avx512bf16");
  return usable;
}

void gemm_bf16_amx(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const bfloat16* a, int64_t lda,
                   const bfloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  bf16_product_scaled(m, n, k, alpha, beta, c, ldc, [&](bool accumulate, float* out, int64_t ld) {
    product(ta, tb, m, n, k, a, lda, b, ldb, accumulate, out, ld);
  });
}

}  // namespace mha::cpu
