// The float32 product of sgemm.h for one instruction set (included by
// sgemm_avx512.cpp and sgemm_avx2.cpp after defining it), blocked as in
// Goto & van de Geijn (2008):
//
//   op(B) (k × n) packed into panels of kPanel columns (two vectors), each
//         panel k rows of kPanel contiguous floats, zero-padded past n
//   op(A) element (r, k) at A[r·ar + k·ak] (ar = lda, ak = 1, or transposed
//         ar = 1, ak = lda); each tile's kRows × kDepth block packed (rows
//         copied, or k-major panels of kGemmRows rows for a transposed A),
//         broadcast one element at a time
//   C     tiles of up to kRows × kCols (smaller when a product has too few
//         for two per thread, taller when it is deeper than kDepth), summed
//         over K blocks of kDepth (depth_t() for a transposed A) straight
//         into C (alpha = 1, beta 0 or 1: every product of the layers;
//         other scalings take the product apart and scale it in). C is not
//         read when beta = 0.
//
// For each K block, one kGemmRows-row group of the tile's packed rows (12 ×
// 256 floats, 12 KiB) stays in L1 while the tile's panels (kDepth × kPanel,
// 32 KiB each) come from L2 in turn. The other way round — a panel held in
// L1 while the tile's groups passed over it — left 32 KiB of panel, 12 KiB
// of rows and C's lines competing for 48 KiB of L1, and the panel's lines
// came back from L2: the 12 × 2-vector micro-tile, 89% of one core's FMA
// peak with everything in L1, ran at 72% over a 4032 × 1024 × 256 product
// that way and at 80% this way (2-vCPU AVX-512 Xeon, 1 thread; the whole
// product 137 -> 153 GFLOP/s). The micro-tile, 12 rows × 2 vectors with
// AVX-512 (24 of 32 registers accumulate), loads 2 vectors of B per 24 FMAs.
// kDepth = 256 takes the layers' k = 256 in one block (192 left a block of
// 64, whose packing and second pass over C cost as much as its products).
//
// A micro-tile that adds to C sums its products from zero and adds C at the
// end, C's lines prefetched as it starts: loaded first, C (a tile of a
// product too large for L2, touched once per K block) held up every
// micro-tile for as long as its 24 lines took to come. Both changes on a
// 2-vCPU AVX-512 Xeon, bench_gemm's mha column at the mid shapes, 1 thread:
// 126-133 -> 139-145 GFLOP/s (weight gradients 91-113 -> 95-115); mid
// training on mha's kernel (MHA_GEMM=mha) 8.74k -> 9.05-9.08k tokens/s.
#include <omp.h>

#include <cstdlib>
#include <memory>
#include <new>

#include "cpu/flash/micro_tile.h"
#include "cpu/scratch.h"
#include "cpu/sgemm/sgemm.h"
#include "cpu/skinny.h"
#include "cpu/transpose.h"

namespace mha::cpu::MHA_ISA_NAMESPACE {

namespace sgemm_detail {

#if defined(MHA_SIMD_AVX512)
constexpr int kGemmRows = 12;
#else
constexpr int kGemmRows = kMR;
#endif
constexpr int64_t kPanel = kNV * W;
constexpr int64_t kRows = 96, kCols = 512, kDepth = 256, kMaxRows = 384;
// The K block of a transposed A (a weight gradient: k = the batch's tokens,
// 1376 to 4078 in the configurations): the fewer blocks, the fewer passes
// over C's tile, each of which loads and stores every line of it, and the
// fewer micro-tiles that start and end; but a group of 12 k-major rows of
// 1024 is 48 KiB, no longer held in L1 beside the panels. Which wins
// differs between cores, measured in one process against other blocks
// (2 threads, beta 1):
//   AMD Zen 5: 1024 against 256: 1024 × 256 × 2096 +4 to +8%, 256 × 256 ×
//     2096 +18%, 256 × 64 × 1376 +11 to +16%, 512 × 512 × 4072 +5 to +8%,
//     2048 × 512 × 4072 -1 to +2%; 384 and 512 gained less, 2048 and 4096
//     no more.
//   Intel Xeon with AMX (family 6, 48 KiB L1, 2 MiB L2): 1024 lost 8-12%
//     against 512 at 2048 × 512 × 4072 and 512 × 512 × 4072 (three runs);
//     512 ran 2-8% ahead of 256 and even to +2% against 384.
//   AVX2 code (6-row groups, Zen 5): 1024 lost 4% at 1024 × 256 × 2096; 512
//     ran even to +8% against 256.
// So 1024 on AMD's AVX-512 cores, 512 elsewhere.
inline int64_t depth_t() {
#if defined(MHA_SIMD_AVX512)
  static const int64_t block = [] {
    __builtin_cpu_init();  // (a product called from another library's constructor may precede libgcc's)
    return __builtin_cpu_is("amd") ? 1024 : 512;
  }();
  return block;
#else
  return 512;
#endif
}
static_assert(kCols % kPanel == 0 && kRows % kGemmRows == 0);

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Rows [0, rows) × K range [0, depth) of op(A) (element (r, k) at A[r·ar +
// k·ak]) packed for the micro-tiles, each copy in its source's direction:
//   rows along k (ak = 1): row-major, out[r·kDepth + k] — a copy of each row
//   otherwise (op(A) = Aᵀ): panels of kGemmRows rows, k-major,
//                           out[(g·depth + k)·kGemmRows + i], row r = g·kGemmRows + i
// Rows past `rows` up to the next multiple of kGemmRows are 0.
inline void pack_rows(const float* A, int64_t ar, int64_t ak, int64_t rows, int64_t depth, float* out) {
  const int64_t padded = round_up(rows, kGemmRows);
  if (ak == 1) {
    for (int64_t r = 0; r < padded; ++r) {
      float* dst = out + r * kDepth;
      if (r < rows)
        for (int64_t k = 0; k < depth; ++k) dst[k] = A[r * ar + k];
      else
        for (int64_t k = 0; k < depth; ++k) dst[k] = 0.0f;
    }
    return;
  }
  // op(A) = Aᵀ: source row k holds element (r, k) of every r, ak apart from
  // the next. Eight source rows at a time, read across, each with the next
  // eight prefetched: a group's 8 × kGemmRows elements of them are
  // contiguous in `out` (k-major), so the copy writes whole lines in order.
  // A source row at a time wrote one group's kGemmRows elements and moved
  // on, pieces of 24 or 48 bytes scattered over every group's panel (6-row
  // groups, 1024 × 256 × 2096, one thread: 3.8 -> 1.5 M cycles a call of
  // about 27 M; by panels, every panel went down all `depth` rows, pages
  // apart, again).
  const int64_t groups = padded / kGemmRows;
  constexpr int64_t kStep = 8;
  for (int64_t k0 = 0; k0 < depth; k0 += kStep) {
    const int64_t k1 = min64(depth, k0 + kStep);
    for (int64_t k = k1; k < min64(depth, k1 + kStep); ++k)
      for (int64_t r = 0; r < rows; r += 16) __builtin_prefetch(A + k * ak + r * ar);
    for (int64_t g = 0; g < groups; ++g) {
      // A group's kGemmRows elements lie together in a source row (ar = 1).
      const int64_t first = g * kGemmRows, here = min64(kGemmRows, rows - first);
      for (int64_t k = k0; k < k1; ++k) {
        const float* src = A + k * ak;
        float* dst = out + (g * depth + k) * kGemmRows;
        if (ar == 1 && here == kGemmRows && kGemmRows <= W) {
          Vec::load_partial(src + first, kGemmRows).store_partial(dst, kGemmRows);
          continue;
        }
        for (int64_t i = 0; i < here; ++i) dst[i] = src[(first + i) * ar];
        for (int64_t i = here; i < kGemmRows; ++i) dst[i] = 0.0f;
      }
    }
  }
}

// C (kGemmRows × kPanel, row stride ldc) (+)= A · P over `depth`: A
// kGemmRows packed rows (pack_rows: row stride kDepth), or with kRowMajor
// false a k-major group, its k-th kGemmRows elements at A + k·a_step (a
// packed panel: a_step = kGemmRows); P a panel of B, its k-th kPanel floats
// at P + k·p_step (packed: kPanel). Both are read at fixed offsets from one
// pointer each, so the loop holds no per-row addresses (twelve of them did
// not fit beside the counters in 16 general registers).
template <bool ACC, bool kRowMajor>
inline void micro_packed(const float* A, int64_t a_step, const float* P, int64_t p_step, float* C, int64_t ldc,
                         int64_t depth, const float* init) {
  Vec acc[kGemmRows][kNV];
  MHA_UNROLL for (int v = 0; v < kNV; ++v) {
    const Vec start = init ? Vec::load(init + v * W) : Vec::zero();
    MHA_UNROLL for (int r = 0; r < kGemmRows; ++r) acc[r][v] = start;
  }
  if (ACC)
    MHA_UNROLL for (int r = 0; r < kGemmRows; ++r)
      MHA_UNROLL for (int v = 0; v < kNV; ++v) __builtin_prefetch(C + r * ldc + v * W, 1, 3);
  for (int64_t k = 0; k < depth; ++k, P += p_step) {
    Vec b[kNV];
    MHA_UNROLL for (int v = 0; v < kNV; ++v) b[v] = Vec::load(P + v * W);
    MHA_UNROLL for (int r = 0; r < kGemmRows; ++r) {
      const Vec a = Vec::set1(kRowMajor ? A[r * kDepth + k] : A[k * a_step + r]);
      MHA_UNROLL for (int v = 0; v < kNV; ++v) acc[r][v] = fma(a, b[v], acc[r][v]);
    }
  }
  MHA_UNROLL for (int r = 0; r < kGemmRows; ++r)
    MHA_UNROLL for (int v = 0; v < kNV; ++v) (ACC ? acc[r][v] + Vec::load(C + r * ldc + v * W) : acc[r][v]).store(C + r * ldc + v * W);
}

// C rows [0, here) × columns [0, width) (row stride ldc) (+)= one group of
// kGemmRows packed rows · P (+ init, a row of kPanel floats, when not null),
// adding to C when `accumulate`. A full group of a
// full panel goes straight to C (no scratch, no second pass); the edges pass
// through a tile on the stack.
inline void group_into(bool row_major, bool accumulate, int64_t here, int64_t width, int64_t depth,
                       const float* a, int64_t a_step, const float* P, int64_t p_step, float* C, int64_t ldc,
                       const float* init) {
  auto run = [&](bool acc, float* out, int64_t ld) {
    if (row_major)
      acc ? micro_packed<true, true>(a, a_step, P, p_step, out, ld, depth, init)
          : micro_packed<false, true>(a, a_step, P, p_step, out, ld, depth, init);
    else
      acc ? micro_packed<true, false>(a, a_step, P, p_step, out, ld, depth, init)
          : micro_packed<false, false>(a, a_step, P, p_step, out, ld, depth, init);
  };
  if (here == kGemmRows && width == kPanel) return run(accumulate, C, ldc);
  alignas(64) float edge[kGemmRows * kPanel];
  if (accumulate)
    for (int64_t i = 0; i < kGemmRows; ++i)
      for (int64_t j = 0; j < kPanel; ++j) edge[i * kPanel + j] = i < here && j < width ? C[i * ldc + j] : 0.0f;
  run(accumulate, edge, kPanel);
  for (int64_t i = 0; i < here; ++i)
    for (int64_t j = 0; j < width; ++j) C[i * ldc + j] = edge[i * kPanel + j];
}

// A product with few rows against a transposed B — C = op(A)·Wᵀ with W (n × k)
// rows along k, as a Linear layer computes for one decoding step — by dot
// products along k (cpu/skinny.h, which has the tiles' shapes): each W row
// is read once, from memory, for every row of A (in L1), with no packing
// (which costs as much as the product when A has a handful of rows).
#if defined(MHA_SIMD_AVX512)
using SkinnyShape = SkinnyShape32;
#else
using SkinnyShape = SkinnyShape16;
#endif

template <int R, int C>
inline void skinny_tile(const float* a, int64_t lda, const float* w, int64_t ldw, int64_t k, int64_t rows, int64_t cols,
                        float alpha, float beta, float* c, int64_t ldc, const float* bias) {
  Vec acc[R][C];
  fill_tile(acc, Vec::zero());
  const auto ar = tile_operands<R>(a, lda, rows);
  const auto wr = tile_operands<C>(w, ldw, cols);
  const auto step = [&](int64_t kk, auto load) {
    Vec av[R], wv[C];
    MHA_UNROLL for (int r = 0; r < R; ++r) av[r] = load(ar[r] + kk);
    MHA_UNROLL for (int j = 0; j < C; ++j) wv[j] = load(wr[j] + kk);
    MHA_UNROLL for (int r = 0; r < R; ++r)
      MHA_UNROLL for (int j = 0; j < C; ++j) acc[r][j] = fma(av[r], wv[j], acc[r][j]);
  };
  int64_t kk = 0;
  for (; kk + W <= k; kk += W) step(kk, [](const float* p) { return Vec::load(p); });
  if (kk < k) step(kk, [n = int(k - kk)](const float* p) { return Vec::load_partial(p, n); });
  store_dot_tile(acc, [](Vec v) { return reduce_add(v); }, rows, cols, alpha, beta, c, ldc, bias);
}

inline void skinny_product(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* w,
                           int64_t ldw, float beta, float* c, int64_t ldc, const float* bias) {
  const auto tile = [&](int64_t r0, int64_t j0, auto tile_rows, auto width, int64_t rows, int64_t cols) {
    skinny_tile<decltype(tile_rows)::value, decltype(width)::value>(a + r0 * lda, lda, w + j0 * ldw, ldw, k, rows,
                                                                    cols, alpha, beta, c + r0 * ldc + j0, ldc,
                                                                    bias ? bias + j0 : nullptr);
  };
  over_dot_tiles<SkinnyShape>(m, n, k, tile);
}

// Whether a product reads op(A) and op(B) where they lie instead of packing
// them: a weight gradient (op(A) = Aᵀ, B as it is) is k-major in both
// already, row k of A holding a group's kGemmRows elements side by side and
// row k of B a panel's kPanel, so the micro-tile can step down A and B by
// their row strides. What that saves is the packing, a pass that reads and
// writes k·(m + n) floats for m·n·k FMAs: most where m and n are small.
// What it costs is locality: a group's k rows of A span k lines instead of
// k·kGemmRows floats, and every row of A or B steps to a new page once the
// strides pass 1 KiB. Measured in bench_gemm (medians of 9, two threads,
// Zen 5, two alternating runs), GFLOP/s packed → in place:
//   AVX-512: 256 × 64 × 1376 274-294 → 367-377, 64 × 64 × 1376 250-270 →
//     317-319, 256 × 256 × 2096 379-413 → 403-429, 256 × 256 × 4078
//     339-343 → 368-376; 64 × 256 × 1376 even; but 1024 × 256 × 2096
//     382-413 → 277, 256 × 1024 × 2096 363-392 → 294, 512 × 512 × 4072
//     379-381 → 330-332 (strides of 2-4 KiB).
//   AVX2 (6-row groups): 256 × 64, 64 × 256 and 64 × 64 × 1376 faster in
//     each of five runs (111-177 → 178-227), 256 × 256 mixed (166-198 →
//     152-190).
// Training steps on AVX-512 (train_throughput, five rounds alternating the
// libraries): small 313-342k → 340-376k tokens/s (medians 339k → 364k),
// mid 15.8-17.9k → 16.1-17.6k (16.75k → 16.93k); long even.
// Panels must be whole (n a multiple of kPanel): a last panel would read
// past B's rows.
inline bool reads_in_place(bool ta, bool tb, int64_t m, int64_t n, int64_t lda, int64_t ldb) {
#if defined(MHA_SIMD_AVX512)
  constexpr int64_t kMaxArea = 256 * 256;
#else
  constexpr int64_t kMaxArea = 256 * 64;
#endif
  return ta && !tb && n % kPanel == 0 && lda <= 256 && ldb <= 256 && m * n <= kMaxArea;
}

// op(B) (k × n) into `panels` panels of kPanel columns at `packed` (the
// layout in sgemm() below). Its loops are shared out among the threads of
// the enclosing parallel region (serial outside one), and end in a barrier.
inline void pack_b(bool tb, const float* b, int64_t ldb, int64_t k, int64_t n, int64_t panels, float* packed) {
  if (!tb) {
    // B's rows along n, each packed row a piece of one: 16 rows at a time,
    // each read from start to end while every panel's 16 rows are written
    // together (whole lines, 16 × kPanel floats). By panels, each panel went
    // down all k rows, one piece of each, ldb apart (256 × 1024 × 2096, one
    // thread: 138 -> 146 GFLOP/s; two threads even).
    constexpr int64_t kChunk = 16;
    const int64_t chunks = (k + kChunk - 1) / kChunk;
#pragma omp for schedule(static)
    for (int64_t ch = 0; ch < chunks; ++ch)
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t j0 = p * kPanel, width = min64(kPanel, n - j0);
        float* panel = packed + p * k * kPanel;
        for (int64_t kk = ch * kChunk; kk < min64(k, (ch + 1) * kChunk); ++kk)
          for (int v = 0; v < kNV; ++v) {
            const int64_t lanes = min64(W, width - v * W);
            const float* src = b + kk * ldb + j0 + v * W;
            (lanes == W ? Vec::load(src) : lanes > 0 ? Vec::load_partial(src, int(lanes)) : Vec::zero())
                .store(panel + kk * kPanel + v * W);
          }
      }
  } else {
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t j0 = p * kPanel, width = min64(kPanel, n - j0);
      float* panel = packed + p * k * kPanel;
      // B is n × k: its rows along k, read 64 at a time so that the packed rows
      // written (64 × kPanel floats) stay in L1 while `width` source rows pass,
      // in 4 × 4 blocks transposed in registers.
      if (width < kPanel)
        for (int64_t kk = 0; kk < k; ++kk)
          for (int64_t j = width; j < kPanel; ++j) panel[kk * kPanel + j] = 0.0f;
      for (int64_t k0 = 0; k0 < k; k0 += 64)
        transpose_block(b + j0 * ldb + k0, ldb, width, min64(k, k0 + 64) - k0, panel + k0 * kPanel, kPanel);
    }
  }
}

}  // namespace sgemm_detail

inline void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                  const float* b, int64_t ldb, float beta, float* c, int64_t ldc, const float* bias) {
  using namespace sgemm_detail;
  if (m <= 0 || n <= 0) return;
  const auto bias_of = [&](int64_t j) { return bias ? bias[j] : 0.0f; };
  if (k == 0) {  // C = beta·C + bias (alpha·op(A)·op(B) is empty)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n; ++j) c[r * ldc + j] = (beta == 0.0f ? 0.0f : beta * c[r * ldc + j]) + bias_of(j);
    return;
  }
  if (!ta && tb && m <= kSkinnyRows) return skinny_product(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, bias);
  if (alpha != 1.0f || (beta != 0.0f && beta != 1.0f)) {
    // Other scalings (no layer asks for them): the product apart, then
    // C = alpha·product + beta·C (C not read for beta = 0).
    // Owned, so that a product that throws (a refused allocation) does not leak it.
    const std::unique_ptr<float, void (*)(void*)> owned(
        static_cast<float*>(std::aligned_alloc(64, size_t(round_up(m * n, 16)) * sizeof(float))), &std::free);
    float* t = owned.get();
    if (!t) throw std::bad_alloc();
    sgemm(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, t, n, nullptr);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n; ++j)
        c[r * ldc + j] =
            (beta == 0.0f ? alpha * t[r * n + j] : alpha * t[r * n + j] + beta * c[r * ldc + j]) + bias_of(j);
    return;
  }
  const int64_t panels = (n + kPanel - 1) / kPanel, n_pad = panels * kPanel;
  // Panel p holds columns [p·kPanel, (p+1)·kPanel) of op(B): row kk at packed + (p·k + kk)·kPanel;
  // the bias, zero-padded to n_pad, after the panels: the accumulators of the
  // first K block start from it (no pass over C to put it there first).
  const bool direct = reads_in_place(ta, tb, m, n, lda, ldb);
  const int64_t packed_floats = direct ? 0 : k * n_pad;
  float* packed = static_cast<float*>(
      thread_scratch_bytes(ScratchSlot::sgemm_b, (packed_floats + n_pad) * int64_t(sizeof(float))));
  float* bias_pad = bias ? packed + packed_floats : nullptr;
  if (bias)
    for (int64_t j = 0; j < n_pad; ++j) bias_pad[j] = j < n ? bias[j] : 0.0f;
  const int64_t ar = ta ? 1 : lda, ak = ta ? lda : 1;
  // Smaller tiles where the product has too few for two per thread (a
  // weight gradient of 64 × 256, say): columns first, then rows.
  const bool threaded = m * n * k > (int64_t(1) << 17);
  const int64_t want = threaded ? 2 * int64_t(omp_get_max_threads()) : 1;
  int64_t tile_rows = kRows, tile_cols = kCols;
  auto items = [&] { return ((m + tile_rows - 1) / tile_rows) * ((n_pad + tile_cols - 1) / tile_cols); };
  while (items() < want && tile_cols > kPanel) tile_cols /= 2;
  while (items() < want && tile_rows > kGemmRows) tile_rows = round_up(tile_rows / 2, kGemmRows);
  // A product deeper than one K block (a weight gradient, k = the batch's
  // tokens) takes its rows in as few tiles as keep every thread busy: a
  // tile's panels of one K block (kDepth × tile_cols, 512 KiB) come into L2
  // once per tile, from a packed B too large for L2 (4078 × 256: 4 MiB), so
  // 96-row tiles brought each block in ceil(m / 96) times, and 11 such tiles
  // of m = 1024 left one of two threads idle for a twelfth of the product
  // (1024 × 256 × 4078, transposed A, 2 threads: 229 -> 251 GFLOP/s).
  if (k > kDepth && items() >= want) {
    // Row tiles: a multiple of `down`, as few as kMaxRows rows allow.
    const int64_t across = (n_pad + tile_cols - 1) / tile_cols, down = (want + across - 1) / across;
    const int64_t tiles = round_up((m + kMaxRows - 1) / kMaxRows, down);
    const int64_t tall = round_up((m + tiles - 1) / tiles, kGemmRows);
    if ((m + tall - 1) / tall >= down) tile_rows = tall;  // (70 rows: 4 tiles of 18 round to 3 of 24)
  }
  const int64_t row_tiles = (m + tile_rows - 1) / tile_rows, col_tiles = (n_pad + tile_cols - 1) / tile_cols;
  // Each thread's packed rows of A, taken before the region (parallel.h).
  const int64_t block = ak == 1 ? kDepth : depth_t();  // K block
  const PerThread row_buffers = per_thread_scratch(ScratchSlot::sgemm_rows, max64(tile_rows, kRows) * block * int64_t(sizeof(float)));
  // One region for the packing of B and the tiles: the threads share the
  // packing even of a small B, which one thread packed while the other
  // waited (1376 × 192 × 64 with a transposed B: 11% of the product's time).
#pragma omp parallel if (threaded || k * n_pad > (int64_t(1) << 16))
  {
    if (!direct) pack_b(tb, b, ldb, k, n, panels, packed);
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t item = 0; item < row_tiles * col_tiles; ++item) {
      const int64_t r0 = item / col_tiles * tile_rows, c0 = item % col_tiles * tile_cols;
      const int64_t rows = min64(tile_rows, m - r0), cols = min64(tile_cols, n_pad - c0);
      float* rows_packed = static_cast<float*>(own_slice(row_buffers));
      for (int64_t k0 = 0; k0 < k; k0 += block) {
        const int64_t depth = min64(block, k - k0);
        // In place (direct): A's whole groups and B's panels where they lie,
        // a last group of fewer rows packed (zero padded); else the tile's
        // rows and B's panels packed.
        const int64_t full = direct ? rows / kGemmRows * kGemmRows : 0;
        if (full < rows) pack_rows(a + (r0 + full) * ar + k0 * ak, ar, ak, rows - full, depth, rows_packed);
        // One group of rows (kGemmRows × depth, 12 KiB) stays in L1 while the
        // tile's panels (kDepth × kPanel each, 32 KiB) come from L2 in turn.
        for (int64_t g = 0; g < rows; g += kGemmRows) {
          const bool packed_group = g >= full;
          const float* group =
              packed_group ? rows_packed + (g - full) * (ak == 1 ? kDepth : depth) : a + (r0 + g) * ar + k0 * ak;
          for (int64_t j = 0; j < cols; j += kPanel)
            group_into(ak == 1, k0 > 0 || beta == 1.0f, min64(kGemmRows, rows - g), min64(kPanel, n - c0 - j), depth,
                       group, packed_group ? kGemmRows : ak,
                       direct ? b + k0 * ldb + c0 + j : packed + ((c0 + j) / kPanel * k + k0) * kPanel,
                       direct ? ldb : kPanel, c + (r0 + g) * ldc + c0 + j, ldc,
                       k0 == 0 && bias ? bias_pad + c0 + j : nullptr);
        }
      }
    }
  }
}

}  // namespace mha::cpu::MHA_ISA_NAMESPACE
