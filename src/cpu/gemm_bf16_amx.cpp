// The bfloat16 matrix product on AMX, the tile unit of Intel's Xeons from
// the 4th generation (Sapphire Rapids) on. A tile register is 16 rows of 64
// bytes; TDPBF16PS C += A·B takes
//   A: 16 rows × 16 pairs along k (32 bfloat16 a row),
//   B: 16 pair rows × 16 columns, word (q, j) = (B[2q][j], B[2q+1][j]) —
//      the pair layout of gemm_bf16_avx512's panels —,
//   C: 16 × 16 float32,
// 16·16·32 multiply-adds in one instruction, issued every 16 cycles: 1024
// FLOP a cycle against the 64 of two 512-bit float32 FMAs.
//
//   op(B) (k × n) packed into panels of 32 columns (two tiles wide) of K2p
//         pair rows, K2p = ceil(k/2) rounded up to a whole tile (16): word
//         (q, j) as above, zeros past k and n
//   op(A) a work item's rows × a chunk of kChunk pairs, tile by tile: tile
//         (r, s) holds rows 16r … 16r+15 and pairs 16s … 16s+15, its rows 64
//         bytes apart (zeros past m and k)
//   C     blocks of 32 × 32: 2 × 2 accumulator tiles, 2 tiles of A and 2 of B
//         for the other four registers
//
// Per step of 32 along k a block loads 4 KiB of tiles for 4 TDPBF16PS. A
// panel's chunk (kChunk pair rows × 128 bytes, 32 KiB) stays in L1 while the
// item's row blocks pass over it; the item's packed A (kItemRows × kChunk
// words, 128 KiB) stays in L2. TDPBF16PS treats bfloat16 denormals as zero
// and flushes denormal results, as vdpbf16ps does.
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "cpu/gemm.h"
#include "cpu/gemm_bf16_scaled.h"
#include "cpu/scratch.h"

namespace mha::cpu {

namespace {

constexpr int64_t kTile = 16;                  // rows of a tile; float32 columns of a C tile; pairs of an A row
constexpr int64_t kPanel = 2 * kTile;          // columns of a B panel
constexpr int64_t kTileWords = kTile * kTile;  // 32-bit words of a tile
constexpr int64_t kItemRows = 128, kChunk = 256;  // kChunk: pairs, a multiple of kTile

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// The tile configuration of every product: eight tiles of 16 rows × 64 bytes
// (palette 1). Tiles 0-3 accumulate C(r, c) at 2r + c, 4-5 hold A, 6-7 B.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = kTile;
  _tile_loadconfig(&config);
}

// Mask of the bfloat16 elements [first, first + 32) that lie below k.
inline __mmask32 below(int64_t first, int64_t k) {
  const int64_t here = k - first;
  return here >= 32 ? ~__mmask32(0) : here <= 0 ? __mmask32(0) : __mmask32((uint64_t(1) << here) - 1);
}

// r[i] (16 words) = column i of the 16 × 16 words r: four rounds of
// shuffles, from 32-bit pairs in each 128-bit lane to whole lanes.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2)
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  // u[4g + x], lane l: words 4l + x of rows 4g … 4g + 3.
  __m512i u[16];
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]), u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]), u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  // Row 4l + x of the result: lane l of u[x], u[4 + x], u[8 + x], u[12 + x].
  for (int x = 0; x < 4; ++x) {
    const __m512i even_lo = _mm512_shuffle_i32x4(u[x], u[4 + x], 0x88), odd_lo = _mm512_shuffle_i32x4(u[x], u[4 + x], 0xdd);
    const __m512i even_hi = _mm512_shuffle_i32x4(u[8 + x], u[12 + x], 0x88),
                  odd_hi = _mm512_shuffle_i32x4(u[8 + x], u[12 + x], 0xdd);
    r[x] = _mm512_shuffle_i32x4(even_lo, even_hi, 0x88), r[8 + x] = _mm512_shuffle_i32x4(even_lo, even_hi, 0xdd);
    r[4 + x] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0x88), r[12 + x] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0xdd);
  }
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

// One C block of RT × CT tiles at c (rows × cols of it inside C, ldc apart)
// (+)= the packed A tiles (row tile 1 `a_next` words after row tile 0) ·
// the panel's pair rows from b, over `steps` tiles of k.
template <int RT, int CT>
void block(const uint32_t* a, int64_t a_next, const uint32_t* b, int64_t steps, bool accumulate, float* c, int64_t ldc,
           int64_t rows, int64_t cols) {
  alignas(64) float edge[4][kTileWords];
  const auto full = [&](int r, int col) { return rows >= kTile * (r + 1) && cols >= kTile * (col + 1); };
  const auto at = [&](int r, int col) { return c + kTile * (r * ldc + col); };
  const auto edge_in = [&](int r, int col) {
    float* e = edge[2 * r + col];
    for (int64_t i = 0; i < kTile; ++i)
      for (int64_t j = 0; j < kTile; ++j)
        e[i * kTile + j] = i < rows - kTile * r && j < cols - kTile * col ? at(r, col)[i * ldc + j] : 0.0f;
    return e;
  };
  // The accumulators, from C or zero. (A tile number must be a constant.)
#define MHA_AMX_START(t, r, col)                                                            \
  if (!accumulate) _tile_zero(t);                                                           \
  else if (full(r, col)) _tile_loadd(t, at(r, col), ldc * int64_t(sizeof(float)));          \
  else _tile_loadd(t, edge_in(r, col), kTile * int64_t(sizeof(float)));
  MHA_AMX_START(0, 0, 0)
  if constexpr (CT == 2) { MHA_AMX_START(1, 0, 1) }
  if constexpr (RT == 2) { MHA_AMX_START(2, 1, 0) }
  if constexpr (RT == 2 && CT == 2) { MHA_AMX_START(3, 1, 1) }
#undef MHA_AMX_START
  for (int64_t s = 0; s < steps; ++s) {
    const uint32_t* bs = b + s * kTile * kPanel;
    _tile_loadd(4, a + s * kTileWords, 64);
    _tile_loadd(6, bs, kPanel * 4);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CT == 2) {
      _tile_loadd(7, bs + kTile, kPanel * 4);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RT == 2) {
      _tile_loadd(5, a + a_next + s * kTileWords, 64);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (CT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
#define MHA_AMX_FINISH(t, r, col)                                              \
  if (full(r, col)) {                                                          \
    _tile_stored(t, at(r, col), ldc * int64_t(sizeof(float)));                 \
  } else {                                                                     \
    float* e = edge[t];                                                        \
    _tile_stored(t, e, kTile * int64_t(sizeof(float)));                        \
    for (int64_t i = 0; i < min64(kTile, rows - kTile * r); ++i)               \
      for (int64_t j = 0; j < min64(kTile, cols - kTile * col); ++j)           \
        at(r, col)[i * ldc + j] = e[i * kTile + j];                            \
  }
  MHA_AMX_FINISH(0, 0, 0)
  if constexpr (CT == 2) { MHA_AMX_FINISH(1, 0, 1) }
  if constexpr (RT == 2) { MHA_AMX_FINISH(2, 1, 0) }
  if constexpr (RT == 2 && CT == 2) { MHA_AMX_FINISH(3, 1, 1) }
#undef MHA_AMX_FINISH
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
    configure_tiles();
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < row_items * col_items; ++item) {
      const int64_t r0 = item / col_items * item_rows, c0 = item % col_items * item_cols;
      const int64_t rows = min64(item_rows, m - r0), cols = min64(item_cols, n - c0);
      const int64_t row_tiles = (rows + kTile - 1) / kTile;
      uint32_t* rows_packed = static_cast<uint32_t*>(own_slice(row_buffers));
      for (int64_t q0 = 0; q0 < K2p; q0 += kChunk) {
        const int64_t steps = min64(kChunk, K2p - q0) / kTile;
        pack_a(ta, &a->bits, lda, m, k, r0, row_tiles, q0, steps, rows_packed);
        const bool acc = q0 > 0 || accumulate;
        for (int64_t j = 0; j < cols; j += kPanel) {
          const uint32_t* panel = packed + ((c0 + j) / kPanel * K2p + q0) * kPanel;
          const int64_t width = min64(kPanel, cols - j);
          for (int64_t rt = 0; rt < row_tiles; rt += 2) {
            const uint32_t* tiles = rows_packed + rt * steps * kTileWords;
            float* out = c + (r0 + rt * kTile) * ldc + c0 + j;
            const int64_t here = min64(kPanel, rows - rt * kTile);
            const int64_t next = steps * kTileWords;
            if (here > kTile) {
              if (width > kTile) block<2, 2>(tiles, next, panel, steps, acc, out, ldc, here, width);
              else block<2, 1>(tiles, next, panel, steps, acc, out, ldc, here, width);
            } else {
              if (width > kTile) block<1, 2>(tiles, next, panel, steps, acc, out, ldc, here, width);
              else block<1, 1>(tiles, next, panel, steps, acc, out, ldc, here, width);
            }
          }
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
  constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
  if ((edx & (kAmxBf16 | kAmxTile)) != (kAmxBf16 | kAmxTile)) return false;
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
