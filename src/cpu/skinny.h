// Skinny products, C (m × n) = alpha · A · Wᵀ + beta · C (+ bias), W (n × k)
// along k and m at most kSkinnyRows (sgemm.h): a Linear layer's decoding
// step. C goes in tiles of R rows of A against C rows of W; each element of
// a tile is one dot product along k, kept as a vector of partial sums and
// added across its lanes at the end. Each instruction set's kernel steps a
// tile along k (sgemm_kernel.h for float32, gemm_bf16_avx512.cpp for
// bfloat16); the tiling and the tile's write to C are here.
#pragma once

#include <array>
#include <cstdint>
#include <numeric>
#include <type_traits>

#include "cpu/simd/sums16.h"
#include "cpu/simd/unroll.h"

namespace mha::cpu {

// Every accumulator of a tile set to x.
template <int R, int C, class V>
[[gnu::always_inline]] inline void fill_tile(V (&acc)[R][C], V x) {
  MHA_UNROLL for (int r = 0; r < R; ++r)
    MHA_UNROLL for (int j = 0; j < C; ++j) acc[r][j] = x;
}

// The N rows of a tile, stride apart from base; those past the first
// `valid` repeat the first (computed, not written).
template <int N, class T>
[[gnu::always_inline]] inline std::array<const T*, N> tile_operands(const T* base, int64_t stride, int64_t valid) {
  std::array<const T*, N> rows;
  MHA_UNROLL for (int i = 0; i < N; ++i) rows[i] = base + (i < valid ? i : 0) * stride;
  return rows;
}

// Writes the first rows × cols of an R × C tile of dot products to C: each
// element alpha · sum(r, j) (the dot product of tile row r and column j),
// plus beta · C (C not read for beta = 0), plus bias[j]. The tile is read by
// constant indices: a run-time index keeps the accumulators on the stack,
// zeroed and stored there around the kernel's loop.
template <int R, int C, class Sum>
[[gnu::always_inline]] inline void write_dot_tile(Sum sum, int64_t rows, int64_t cols, float alpha, float beta,
                                                  float* c, int64_t ldc, const float* bias) {
  MHA_UNROLL for (int r = 0; r < R; ++r)
    MHA_UNROLL for (int j = 0; j < C; ++j) {
      if (r >= rows || j >= cols) continue;
      const float dot = alpha * sum(r, j);
      float* out = c + r * ldc + j;
      *out = (beta == 0.0f ? dot : dot + beta * *out) + (bias ? bias[j] : 0.0f);
    }
}

#if defined(__AVX512F__)
// A tile's accumulator as __m512: itself, or the vector type's register.
[[gnu::always_inline]] inline __m512 as_m512(__m512 v) { return v; }
template <class V>
[[gnu::always_inline]] inline __m512 as_m512(const V& v) {
  return v.v;
}
#endif

// write_dot_tile of the tile's accumulators, each summed across its lanes by
// reduce; a 4 × 4 tile of 512-bit accumulators all sixteen at once by
// sums16 (in the order reduce_add takes them).
template <int R, int C, class V, class Reduce>
[[gnu::always_inline]] inline void store_dot_tile(const V (&acc)[R][C], Reduce reduce, int64_t rows, int64_t cols,
                                                  float alpha, float beta, float* c, int64_t ldc, const float* bias) {
#if defined(__AVX512F__)
  if constexpr (R == 4 && C == 4 && sizeof(V) == sizeof(__m512)) {
    __m512 a[16];
    MHA_UNROLL for (int q = 0; q < 16; ++q) a[q] = as_m512(acc[q % 4][q / 4]);
    alignas(64) float sums[16];
    _mm512_store_ps(sums, sums16(a));
    return write_dot_tile<4, 4>([&](int r, int j) { return sums[4 * r + j]; }, rows, cols, alpha, beta, c, ldc, bias);
  }
#endif
  write_dot_tile<R, C>([&](int r, int j) { return reduce(acc[r][j]); }, rows, cols, alpha, beta, c, ldc, bias);
}

// The tiles' shapes. A tile of R rows × C columns of C holds R·C
// accumulators and loads R + C vectors per R·C FMAs (or dot-product
// instructions); where fewer than R rows are left, the kernel built for
// tile_rows<left> rows computes them (rows past m repeat the first, not
// written), cols<left> columns wide. Measured on Zen 5, 2 threads, in
// GFLOP/s, against 4 × 4 tiles throughout (the shape before these):
//   32 vector registers (AVX-512): 4 × 4, and 1 × 8 for m = 1 (one sequence
//   decoding): 74-96 against 57-70 over 4000 calls at n 1024, k 256 and n
//   256, k 1024 (1 × 16: 66-69 at k 1024). Two or three rows left take
//   4 × 4: at m = 2 (n 256, k 1024) tiles of 2 × 4, 2 × 6, 2 × 8 and 2 × 12
//   ran at 113-116, 115-135, 107-109 and 93-100 against 132-135 for 4 × 4
//   with two rows repeated, whose 16 accumulators cover the FMA latency on
//   four rows of W.
//   16 (AVX2): 4 × 3, and exactly the rows left: 3 × 4, 2 × 6, 1 × 12. A
//   4 × 4 tile spilled two accumulators to the stack and read each W vector
//   from memory four times (22 loads and 2 stores per 16 FMAs). At the mid
//   model's shapes (bench_gemm --config decode1, 2, 16): 1 row 62-82 against
//   23-33, 2 rows 86-114 against 39-55, 16 rows 100-128 against 86-102.
struct SkinnyShape32 {
  static constexpr int rows = 4;
  template <int R>
  static constexpr int tile_rows = R == 1 ? 1 : 4;
  template <int R>
  static constexpr int cols = R == 1 ? 8 : 4;
};
struct SkinnyShape16 {
  static constexpr int rows = 4;
  template <int R>
  static constexpr int tile_rows = R;
  template <int R>
  static constexpr int cols = R == 4 ? 3 : R == 3 ? 4 : R == 2 ? 6 : 12;
};

// Calls f(std::integral_constant<int, rows>) for rows from 1 to R.
template <int R, class F>
[[gnu::always_inline]] inline void with_rows(int64_t rows, const F& f) {
  if constexpr (R > 1)
    if (rows < R) return with_rows<R - 1>(rows, f);
  f(std::integral_constant<int, R>{});
}

// tile(r0, j0, tile_rows, width, rows, cols) for each tile of the m × n
// product, in Shape's tiles: tile_rows and width are std::integral_constants
// (the kernel built for them), rows ≤ tile_rows and cols ≤ width the part
// written. The threads share chunks of columns, the least common multiple
// of the widths that m's tiles take, each W row read once, where the
// product is large enough to pay for them.
template <class Shape, class Tile>
void over_dot_tiles(int64_t m, int64_t n, int64_t k, const Tile& tile) {
  int64_t chunk = 1;
  const auto widen = [&](auto left) { chunk = std::lcm(chunk, int64_t(Shape::template cols<decltype(left)::value>)); };
  if (m >= Shape::rows) widen(std::integral_constant<int, Shape::rows>{});
  if (m % Shape::rows) with_rows<Shape::rows>(m % Shape::rows, widen);
  const int64_t chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) if (m * n * k > (int64_t(1) << 17) && chunks > 1)
  for (int64_t q = 0; q < chunks; ++q) {
    const int64_t end = n < (q + 1) * chunk ? n : (q + 1) * chunk;
    for (int64_t r0 = 0; r0 < m; r0 += Shape::rows)
      with_rows<Shape::rows>(m - r0, [&](auto left) {
        constexpr int tile_rows = Shape::template tile_rows<decltype(left)::value>;
        constexpr int width = Shape::template cols<decltype(left)::value>;
        static_assert(tile_rows >= decltype(left)::value);
        for (int64_t j0 = q * chunk; j0 < end; j0 += width)
          tile(r0, j0, std::integral_constant<int, tile_rows>{}, std::integral_constant<int, width>{},
               int64_t(decltype(left)::value), end - j0 < width ? end - j0 : width);
      });
  }
}

}  // namespace mha::cpu
