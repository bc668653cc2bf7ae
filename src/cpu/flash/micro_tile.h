// The float32 products of the fused attention kernels (kernel.h) on
// register micro-tiles: MR rows × NV vectors of C accumulate while B's
// vectors stream past and A's elements are broadcast, and the small
// products (a key tile against a query tile, at most 64 × 64 × E) built
// from them. Compiled once per instruction set inside MHA_ISA_NAMESPACE, as
// kernel.h; sgemm_kernel.h sizes its own micro-tiles from kMR and kNV.
#pragma once

#include <cstdint>

#include "cpu/simd/vec.h"

namespace mha::cpu::MHA_ISA_NAMESPACE {

constexpr int W = Vec::W;
constexpr int64_t kLineFloats = 64 / int64_t(sizeof(float));  // floats in a cache line

#if defined(MHA_SIMD_AVX512)
constexpr int kMR = 8;  // rows per micro-tile: 8 × 2 vectors = 16 of 32 registers
#elif defined(MHA_SIMD_AVX2)
constexpr int kMR = 6;  // 6 × 2 = 12 of 16 registers
#else
constexpr int kMR = 4;
#endif
constexpr int kNV = 2;  // vectors per micro-tile row

// Rows of a float32 micro-tile NV vectors wide: MR × NV accumulators, NV
// vectors of B and a broadcast in the registers. On AVX-512 (32 registers)
// 6 × 4 where a tile is 64 columns wide: 10 loads per 24 FMAs against 10 per
// 16 for 8 × 2 (attention at L = 2039, E = 64, medians of four alternating
// runs: forward 20.8 -> 19.2 ms, backward 47.4 -> 43.5 ms); 12 × 2 and 16 × 1
// for narrower tiles measured no better than 8 × 2 and 8 × 1.
template <int NV>
constexpr int rows_for() {
#if defined(MHA_SIMD_AVX512)
  if (NV == 4) return 6;
#endif
  return kMR;
}

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// C[r][c] (+)= Σ_k A[r·ar + k·ak] · B[k·ldb + c] for r < MR, c < NV·W.
// Adding to C, the sum starts from zero and C is added at the end, its lines
// prefetched as the tile starts: loaded first, a C from L2 (dQ's rows, the
// key gradients' accumulators) held up the tile's first FMAs (backward at
// (8, 2040, 64): 41.1 -> 40.2 ms, (64, 509, 64): 26.8 -> 26.0 ms).
template <int MR, int NV, bool ACC>
inline void micro(const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb, float* C, int64_t ldc,
                  int64_t K) {
  Vec acc[MR][NV];
  MHA_UNROLL for (int r = 0; r < MR; ++r)
    MHA_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = Vec::zero();
  if (ACC)
    MHA_UNROLL for (int r = 0; r < MR; ++r)
      MHA_UNROLL for (int v = 0; v < NV; ++v) __builtin_prefetch(C + r * ldc + v * W, 1, 3);
  for (int64_t k = 0; k < K; ++k) {
    Vec b[NV];
    MHA_UNROLL for (int v = 0; v < NV; ++v) b[v] = Vec::load(B + k * ldb + v * W);
    MHA_UNROLL for (int r = 0; r < MR; ++r) {
      const Vec a = Vec::set1(A[r * ar + k * ak]);
      MHA_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = fma(a, b[v], acc[r][v]);
    }
  }
  MHA_UNROLL for (int r = 0; r < MR; ++r)
    MHA_UNROLL for (int v = 0; v < NV; ++v) (ACC ? acc[r][v] + Vec::load(C + r * ldc + v * W) : acc[r][v]).store(C + r * ldc + v * W);
}

template <int MR, int NV, bool ACC>
inline void micro_rows(int64_t rows, const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb, float* C,
                       int64_t ldc, int64_t K) {
  static_assert(MR <= 16, "micro_rows handles up to 16 rows");
  switch (rows) {
#define MHA_ROWS_CASE(n) \
  case n: return micro<(n < MR ? n : MR), NV, ACC>(A, ar, ak, B, ldb, C, ldc, K);
    MHA_ROWS_CASE(1) MHA_ROWS_CASE(2) MHA_ROWS_CASE(3) MHA_ROWS_CASE(4)
    MHA_ROWS_CASE(5) MHA_ROWS_CASE(6) MHA_ROWS_CASE(7) MHA_ROWS_CASE(8)
    MHA_ROWS_CASE(9) MHA_ROWS_CASE(10) MHA_ROWS_CASE(11) MHA_ROWS_CASE(12)
    MHA_ROWS_CASE(13) MHA_ROWS_CASE(14) MHA_ROWS_CASE(15) MHA_ROWS_CASE(16)
#undef MHA_ROWS_CASE
    default: return;
  }
}

// Cache lines [0, lines) from p, to bring into L2 while a product runs: a
// share of them before each of its micro-tiles, so that their misses go out
// a few at a time among the FMAs instead of all at once.
struct Ahead {
  const float* p = nullptr;
  int64_t lines = 0;
};

// The lines of a that fall to parts [from, to) of n equal parts.
inline Ahead part(const Ahead& a, int64_t from, int64_t to, int64_t n) {
  const int64_t first = a.lines * from / n, last = a.lines * to / n;
  return {a.p + first * kLineFloats, last - first};
}

inline void prefetch_to_l2(const Ahead& a) {
  for (int64_t x = 0; x < a.lines; ++x) __builtin_prefetch(a.p + x * kLineFloats, 0, 2);
}

// f(r0, rows) for each tile of MR rows of R in turn, each tile's share of
// `ahead` brought into L2 before it.
template <int MR, class F>
inline void over_row_tiles(int64_t R, const Ahead& ahead, F&& f) {
  const int64_t tiles = (R + MR - 1) / MR;
  for (int64_t r0 = 0; r0 < R; r0 += MR) {
    prefetch_to_l2(part(ahead, r0 / MR, r0 / MR + 1, tiles));
    f(r0, min64(MR, R - r0));
  }
}

// C's columns [c0, c0 + NV·W) over all R rows, a micro-tile of rows_for<NV>() rows at a time.
template <int NV, bool ACC>
inline void gemm_columns(int64_t R, int64_t K, const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb,
                         float* C, int64_t ldc, int64_t c0, const Ahead& ahead) {
  constexpr int MR = rows_for<NV>();
  over_row_tiles<MR>(R, ahead, [&](int64_t r0, int64_t rows) {
    micro_rows<MR, NV, ACC>(rows, A + r0 * ar, ar, ak, B + c0, ldb, C + r0 * ldc + c0, ldc, K);
  });
}

// C (R × N, N a multiple of W) (+)= A (R × K, strides ar, ak) · B (K × N, row
// stride ldb), bringing `ahead` into L2 on the way.
//
// AVX-512 goes a block of columns at a time down all the rows (a tile of
// rows at a time across the columns: mid's forward, (128, 131, 32) causal,
// about 5% slower on Zen 5, three alternating runs). The 256-bit and
// portable code, whose blocks are narrower, go a tile of rows at a time
// across all the columns, so that what stays in L1 is B (K × N) and one
// tile's rows of A, not all of A and one block of B: the forward's products
// on AVX2 (N = 64 queries in 2-vector blocks, K and V tiles of 64 × 64) read
// all of A once per block, 48 KiB in play against the 32 KiB L1 of the AVX2
// machine measured (Zen 3). Under cachegrind with that L1 and a 512 KiB L2,
// (2, 2039, 64) causal, one thread, L1 read misses: forward 6.6 -> 4.9 M,
// backward 11.2 -> 8.7 M. On a Zen 5 (48 KiB L1) with AVX2 code the times
// stayed within the noise. Either way every element sums its k in order, in
// one micro-tile.
template <bool ACC>
void gemm(int64_t R, int64_t N, int64_t K, const float* A, int64_t ar, int64_t ak, const float* B, int64_t ldb,
          float* C, int64_t ldc, const Ahead& ahead = {}) {
#if defined(MHA_SIMD_AVX512)
  int64_t c0 = 0;
  for (; c0 + 4 * W <= N; c0 += 4 * W)
    gemm_columns<4, ACC>(R, K, A, ar, ak, B, ldb, C, ldc, c0, part(ahead, c0, c0 + 4 * W, N));
  for (; c0 + 2 * W <= N; c0 += 2 * W)
    gemm_columns<2, ACC>(R, K, A, ar, ak, B, ldb, C, ldc, c0, part(ahead, c0, c0 + 2 * W, N));
  for (; c0 < N; c0 += W) gemm_columns<1, ACC>(R, K, A, ar, ak, B, ldb, C, ldc, c0, part(ahead, c0, c0 + W, N));
#else
  over_row_tiles<kMR>(R, ahead, [&](int64_t r0, int64_t rows) {
    int64_t c0 = 0;
    for (; c0 + 2 * W <= N; c0 += 2 * W)
      micro_rows<kMR, 2, ACC>(rows, A + r0 * ar, ar, ak, B + c0, ldb, C + r0 * ldc + c0, ldc, K);
    for (; c0 < N; c0 += W) micro_rows<kMR, 1, ACC>(rows, A + r0 * ar, ar, ak, B + c0, ldb, C + r0 * ldc + c0, ldc, K);
  });
#endif
}

}  // namespace mha::cpu::MHA_ISA_NAMESPACE
