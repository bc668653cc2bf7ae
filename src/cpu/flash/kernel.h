// Fused attention kernels, written once against cpu/simd/vec.h and compiled
// once per instruction set (kernel_avx512.cpp, kernel_avx2.cpp,
// kernel_scalar.cpp). Algorithm: FlashAttention-2 (Dao, 2023) with scores
// in the base-2 domain: Q is pre-scaled by scale·log2(e), so softmax uses exp2.
//
// Forward, per query tile (queries in vector lanes), per key tile of Bc keys:
//   S_T = K_tile · Q_Tᵀ                      (Bc × br; + mask·log2e; band → -inf)
//   m'  = max(m, colmax S_T);  P_T = exp2(S_T - m');  α = exp2(m - m')
//   l   = α·l + colsum P_T;    O_T = α·O_T + V_tileᵀ · (P_T ∘ dropout)
// and at the end O = O_T / l, lse = (m + log2 l)·ln 2.
// Backward, per batch entry, per key tile (dK, dV stay in registers/L1):
//   P_T = exp2(S_T - lse2),  dP_T = V_tile · dO_Tᵀ
//   dV += (P_T∘F) · dO,  dS_T = P_T ∘ (dP_T∘F - D),  dK += scale·dS_T · Q,  dQ += scale·dS · K_tile
// with F the dropout factors and D = rowsum(dO∘O) (so dS is the gradient of
// the natural-log logits, and scale·dS that of the raw dot products).
//
// No std:: or other inline functions shared with other translation units are
// used here: a copy compiled for AVX-512 must never be picked by the linker
// for the portable path.
#pragma once

#include "cpu/flash/flash.h"
#include "cpu/flash/micro_tile.h"
#include "cpu/simd/vec.h"

namespace mha::cpu::MHA_ISA_NAMESPACE {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Whether every (query, key) of the tile is inside the band.
inline bool tile_inside_band(int64_t i0, int64_t rows, int64_t j0, int64_t cols, Band b) {
  // Tightest row: the last query has the largest lower bound, the first the smallest upper bound.
  return j0 >= i0 + rows - 1 + b.lo_shift && j0 + cols <= i0 + b.hi_shift;
}

// The multiplier that turns a finished score into its base-2 logit: c
// without a mask (the scores stay raw), 1 with one (c is already in them).
inline float logit_multiplier(const float* mask, float c) { return mask ? 1.0f : c; }

// Prepares raw dot products S_T for the softmax: with a mask, S_T becomes
// S_T·c + mask·log2(e) and the returned multiplier is 1; without one, S_T is
// left raw and the multiplier c = scale·log2(e) is applied inside exp2 (one
// rounding either way, as in the reference path). Keys outside the band → -inf.
inline float finish_scores(float* st, int64_t br, float c, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                           Band band, const float* mask, int64_t mask_row, int64_t mask_col) {
  if (mask) {
    const Vec cv = Vec::set1(c);
    for (int64_t x = 0; x < cols * br; x += W) (Vec::load(st + x) * cv).store(st + x);
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t i = 0; i < rows; ++i) st[j * br + i] += mask[i * mask_row + (j0 + j) * mask_col] * kLog2e;
  }
  if (!tile_inside_band(i0, rows, j0, cols, band))
    for (int64_t j = 0; j < cols; ++j) {
      // Key j0+j is visible to queries i0+i with key - hi < i0+i <= key - lo: one run of lanes.
      const int64_t key = j0 + j;
      const int64_t first = max64(0, min64(rows, key - band.hi_shift + 1 - i0));
      const int64_t last = max64(first, min64(rows, key - band.lo_shift + 1 - i0));
      float* row = st + j * br;
      for (int64_t i = 0; i < first; ++i) row[i] = -__builtin_inff();
      for (int64_t i = last; i < rows; ++i) row[i] = -__builtin_inff();
    }
  return logit_multiplier(mask, c);
}

// P = exp2(s·c - lse2) from the saved lse, with the logit s·c rounded to
// float first, as the forward rounded the row's max m. Where one logit
// dominates, l ≈ 1 and lse2 = m + log2 l rounds to m, so the rounded logit
// gives P = 1 exactly; fused into fma(s, c, -lse2), the product's rounding
// error, up to half an ulp of s·c (2 at logits of 3.6e7), would stay in the
// exponent (P = 0.73 for a one-hot row). The float32 lse costs an exponent
// error of up to about ε·|lse2| anyway (one-hot rows at logits of 1e3 to 1e8:
// 108 of 6096 other than P = 1 this way, 2829 fused), which past |lse2| ≈ 2^24
// is a unit and more: P = 2^8 at 1e8. P ≤ 1 holds exactly; holding it there
// bounds P's error by 1 however large that gets. min(1, p) returns p when p
// is NaN (vec.h), so NaN still passes through.
inline Vec probability(Vec s, Vec c, Vec lse2) { return min(Vec::set1(1.0f), exp2(mul_rounded(s, c) - lse2)); }

// The saved natural-log lse back in base 2, in float as dispatch.cpp converts
// it for the backward (float's ln 2 and log2 e round-trip better than one
// rounding in double: 108 against 581 of 6096 one-hot rows at logits of 1e3
// to 1e8 came back other than P = 1).
inline float lse_base2(float lse) { return lse * kLog2e; }

// Keys that any query of [i0, i0+rows) can see.
inline void key_range(int64_t i0, int64_t rows, int64_t S, Band b, int64_t& lo, int64_t& hi) {
  lo = max64(0, i0 + b.lo_shift);
  hi = min64(S, i0 + rows - 1 + b.hi_shift);
}

// Whether the band and the mask leave query t.i0 + i any key. l = 0 with a
// key left means every logit it was allowed was -inf from the data (q or k
// infinite), which is NaN in exact arithmetic, not an empty row. Rare: run
// only then.
inline bool row_allows_a_key(const FlashForwardTile& t, int64_t i) {
  const int64_t lo = max64(0, t.i0 + i + t.band.lo_shift), hi = min64(t.S, t.i0 + i + t.band.hi_shift);
  if (!t.mask) return lo < hi;
  for (int64_t j = lo; j < hi; ++j)
    if (t.mask[i * t.mask_row + j * t.mask_col] != -__builtin_inff()) return true;
  return false;
}

// The forward's two products on float32 operands.
struct FloatProducts {
  const FlashForwardTile& t;
  static constexpr int64_t key_align = 1;
  // S_T (cols × br) = K[j0 …] · Q_T
  void scores(int64_t j0, int64_t cols, float* st) const {
    gemm<false>(cols, t.br, t.E, t.k + j0 * t.k_row, t.k_row, 1, t.qt, t.br, st, t.br);
  }
  // O_T (Ev × br) += V[j0 …]ᵀ · P_T: A(e, j) = V[j0 + j][e].
  void accumulate(int64_t j0, int64_t cols, const float* pt, float* ot) const {
    gemm<true>(t.Ev, t.br, cols, t.v + j0 * t.v_row, 1, t.v_row, pt, t.br, ot, t.br);
  }
};

template <class Products>
void forward_tile_with(const FlashForwardTile& t, const Products& products) {
  const int64_t br = t.br, nv = br / W;
  float* st = t.scratch;                          // (Bc, br)
  float* factors = st + kFlashKeyTile * br;       // (Bc, br)
  float* ot = factors + kFlashKeyTile * br;       // (Ev, br), rows to a multiple of 16 (AMX tiles)
  float* m = ot + flash_value_rows(t.Ev) * br;    // (br): running max, base-2 logits
  float* l = m + br;                              // (br): running sum
  int64_t lo, hi;
  key_range(t.i0, t.rows, t.S, t.band, lo, hi);
  const bool weights_pass = t.weights != nullptr;
  const Vec lowest = Vec::set1(-3.402823466e38f);

  if (weights_pass) {  // m holds lse·log2e (+inf for a fully masked or pad row: P = 0)
    for (int64_t i = 0; i < br; ++i)
      m[i] = i < t.rows && t.lse[i] != -__builtin_inff() ? lse_base2(t.lse[i]) : __builtin_inff();
    for (int64_t i = 0; i < t.rows; ++i)
      for (int64_t j = 0; j < t.S; ++j) t.weights[i * t.weights_row + j] = 0.0f;
  } else {
    for (int64_t i = 0; i < br; ++i) m[i] = -3.402823466e38f, l[i] = 0.0f;
    for (int64_t x = 0; x < flash_value_rows(t.Ev) * br; ++x) ot[x] = 0.0f;
  }

  // Products that pair keys start at an even key; the extra key is outside the band.
  for (int64_t j0 = lo / Products::key_align * Products::key_align; j0 < hi; j0 += kFlashKeyTile) {
    const int64_t cols = min64(kFlashKeyTile, hi - j0);
    products.scores(j0, cols, st);
    const Vec c = Vec::set1(
        finish_scores(st, br, t.logit_scale, t.i0, t.rows, j0, cols, t.band, t.mask, t.mask_row, t.mask_col));
    if (t.dropout.fill) t.dropout.fill(t.dropout.ctx, t.i0, t.rows, j0, cols, factors, br);

    if (weights_pass) {
      for (int64_t v = 0; v < nv; ++v) {
        const Vec lse2 = Vec::load(m + v * W);
        for (int64_t j = 0; j < cols; ++j) {
          Vec p = probability(Vec::load(st + j * br + v * W), c, lse2);
          if (t.dropout.fill) p = p * Vec::load(factors + j * br + v * W);
          p.store(st + j * br + v * W);
        }
      }
      for (int64_t i = 0; i < t.rows; ++i)
        for (int64_t j = 0; j < cols; ++j) t.weights[i * t.weights_row + j0 + j] = st[j * br + i];
      continue;
    }

    // The finished scores, kept for the backward (j0: a whole key tile from
    // key 0), leave in streaming stores as the loop below reads them: written
    // to memory without reading the lines first, and not left in the caches
    // that the tile works in. All of a tile's 256 lines in a row after its
    // product, the stores waited on line-fill buffers: at (8, 2039, 64)
    // causal on 2 threads (AVX-512 Xeon, five alternating runs), the forward
    // took 18.5 ms against 17.2 this way (medians); one head on one thread,
    // keeping cost 2.2k cycles a tile pair against 1.4k (of about 26k).
    float* kept = t.scores ? t.scores + j0 * br : nullptr;
    bool rescale = false;
    float alpha_lanes[kFlashQueryTileMax];
    // Up to four vectors of lanes at a time, each its own chain of max and of
    // sums (one chain made every max wait on the last: 23% of the softmax's
    // cycles on one vmaxps); each lane still sums its keys in order.
    for (int64_t v0 = 0; v0 < nv; v0 += 4) {
      const int64_t group = min64(4, nv - v0);
      Vec raw_max[4], neg_m[4], sum[4];
      for (int64_t v = 0; v < group; ++v) raw_max[v] = Vec::load(st + (v0 + v) * W);
      for (int64_t j = 1; j < cols; ++j)
        for (int64_t v = 0; v < group; ++v) raw_max[v] = max(raw_max[v], Vec::load(st + j * br + (v0 + v) * W));
      for (int64_t v = 0; v < group; ++v) {
        // The multiplier is positive, so the max of raw scores gives the max of logits.
        // -FLT_MAX instead of -inf keeps (-inf) - (-inf) = NaN out of exp2.
        const Vec m_old = Vec::load(m + (v0 + v) * W);
        const Vec m_new = max(m_old, max(raw_max[v] * c, lowest));
        neg_m[v] = Vec::zero() - m_new, sum[v] = Vec::zero();
        const Vec alpha = exp2(m_old - m_new);
        alpha.store(alpha_lanes + (v0 + v) * W);
        m_new.store(m + (v0 + v) * W);
      }
      for (int64_t j = 0; j < cols; ++j)
        for (int64_t v = 0; v < group; ++v) {
          float* row = st + j * br + (v0 + v) * W;
          const Vec s = Vec::load(row);
          if (kept) s.stream(kept + j * br + (v0 + v) * W);
          Vec p = exp2(fma(s, c, neg_m[v]));
          sum[v] = sum[v] + p;
          if (t.dropout.fill) p = p * Vec::load(factors + j * br + (v0 + v) * W);
          p.store(row);
        }
      for (int64_t v = 0; v < group; ++v)
        fma(Vec::load(l + (v0 + v) * W), Vec::load(alpha_lanes + (v0 + v) * W), sum[v]).store(l + (v0 + v) * W);
    }
    for (int64_t i = 0; i < br; ++i) rescale |= alpha_lanes[i] != 1.0f;
    if (rescale)  // once the row maxima settle, alpha = 1 and O_T needs no rescaling
      for (int64_t e = 0; e < t.Ev; ++e)
        for (int64_t v = 0; v < nv; ++v)
          (Vec::load(ot + e * br + v * W) * Vec::load(alpha_lanes + v * W)).store(ot + e * br + v * W);
    products.accumulate(j0, cols, st, ot);
  }
  if (weights_pass) return;
  if (t.scores) stream_fence();  // the kept scores in memory before another thread reads them

  // l = 0: no key reached the row. A NaN l (a NaN or infinite logit) makes
  // the row's output and lse NaN, for the dispatcher to notice.
  for (int64_t i = 0; i < t.rows; ++i) {
    const float li = l[i];
    const float inv = li == 0.0f ? 0.0f : 1.0f / li;
    float* o = t.out + i * t.out_row;
    for (int64_t e = 0; e < t.Ev; ++e) o[e] = ot[e * br + i] * inv;
    t.lse[i] = li == 0.0f ? (row_allows_a_key(t, i) ? __builtin_nanf("") : -__builtin_inff())
                          : (m[i] + __builtin_log2f(li)) * kLn2;
  }
}

inline void forward_tile(const FlashForwardTile& t) { forward_tile_with(t, FloatProducts{t}); }

#if defined(MHA_SIMD_AVX512)
// bfloat16 products with AVX512-BF16: vdpbf16ps multiplies pairs of bf16 and
// adds both products into one float lane, so operands are stored in pairs
// along the reduction: queries (e, e+1), values (j, j+1), probabilities (j, j+1).

// C[r][c] (+)= Σ_k2 A2[r·ar + k2·ak] · B2[k2][c], where A2 holds one bf16 pair
// per 32-bit word and B2 rows hold W lanes × 2 bf16.
template <int MR, int NV, bool ACC>
inline void micro_bf16(const uint32_t* A, int64_t ar, int64_t ak, const uint16_t* B, int64_t ldb, float* C,
                       int64_t ldc, int64_t K2) {
  __m512 acc[MR][NV];
  MHA_UNROLL for (int r = 0; r < MR; ++r)
    MHA_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = ACC ? _mm512_loadu_ps(C + r * ldc + v * W) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh b[NV];
    MHA_UNROLL for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + k * ldb + v * 2 * W);
    MHA_UNROLL for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int(A[r * ar + k * ak]));
      MHA_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  MHA_UNROLL for (int r = 0; r < MR; ++r)
    MHA_UNROLL for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + v * W, acc[r][v]);
}

template <int NV, bool ACC>
inline void micro_bf16_rows(int64_t rows, const uint32_t* A, int64_t ar, int64_t ak, const uint16_t* B, int64_t ldb,
                            float* C, int64_t ldc, int64_t K2) {
  switch (rows) {
#define MHA_ROWS_CASE(n) \
  case n: return micro_bf16<(n < kMR ? n : kMR), NV, ACC>(A, ar, ak, B, ldb, C, ldc, K2);
    MHA_ROWS_CASE(1) MHA_ROWS_CASE(2) MHA_ROWS_CASE(3) MHA_ROWS_CASE(4)
    MHA_ROWS_CASE(5) MHA_ROWS_CASE(6) MHA_ROWS_CASE(7) MHA_ROWS_CASE(8)
#undef MHA_ROWS_CASE
    default: return;
  }
}

template <bool ACC>
void gemm_bf16(int64_t R, int64_t N, int64_t K2, const uint32_t* A, int64_t ar, int64_t ak, const uint16_t* B,
               int64_t ldb, float* C, int64_t ldc) {
  int64_t c0 = 0;
  for (; c0 + kNV * W <= N; c0 += kNV * W)
    for (int64_t r0 = 0; r0 < R; r0 += kMR)
      micro_bf16_rows<kNV, ACC>(min64(kMR, R - r0), A + r0 * ar, ar, ak, B + 2 * c0, ldb, C + r0 * ldc + c0, ldc, K2);
  for (; c0 < N; c0 += W)
    for (int64_t r0 = 0; r0 < R; r0 += kMR)
      micro_bf16_rows<1, ACC>(min64(kMR, R - r0), A + r0 * ar, ar, ak, B + 2 * c0, ldb, C + r0 * ldc + c0, ldc, K2);
}

// out (ceil(cols/2), br, 2) = rows j and j+1 of x (cols × br) rounded to
// bfloat16 and interleaved lane by lane: [x_j(i), x_j+1(i)] for each query i
// (0 for the partner of an odd last row).
inline void pairs_along_keys(const float* x, int64_t br, int64_t cols, uint16_t* out) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                               22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t j2 = 0; j2 < (cols + 1) / 2; ++j2)
    for (int64_t v = 0; v < br / W; ++v) {
      const __m512 lo = _mm512_loadu_ps(x + 2 * j2 * br + v * W);
      const __m512 hi = 2 * j2 + 1 < cols ? _mm512_loadu_ps(x + (2 * j2 + 1) * br + v * W) : _mm512_setzero_ps();
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // low half lo, high half hi
      _mm512_storeu_si512(out + (j2 * br + v * W) * 2, _mm512_permutexvar_epi16(interleave, both));
    }
}

// out (rows × out_row bfloat16) = x (rows × br float, br a multiple of W)
// rounded to nearest even, zero in columns br … out_row.
inline void round_rows(const float* x, int64_t rows, int64_t br, uint16_t* out, int64_t out_row) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < br; k += W)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_row + k),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * br + k)));
    for (int64_t k = br; k < out_row; ++k) out[r * out_row + k] = 0;
  }
}

struct Bf16Products {
  const FlashForwardTile& t;
  uint16_t* pt2;  // (Bc/2, br, 2): probabilities in key pairs
  static constexpr int64_t key_align = 2;

  void scores(int64_t j0, int64_t cols, float* st) const {
    const int64_t e2 = (t.E + 1) / 2;
    gemm_bf16<false>(cols, t.br, e2, reinterpret_cast<const uint32_t*>(t.k16 + j0 * t.k16_row), t.k16_row / 2, 1,
                     t.qt2, 2 * t.br, st, t.br);
  }
  void accumulate(int64_t j0, int64_t cols, const float* pt, float* ot) const {
    pairs_along_keys(pt, t.br, cols, pt2);
    gemm_bf16<true>(t.Ev, t.br, (cols + 1) / 2, reinterpret_cast<const uint32_t*>(t.v2 + j0 * t.Ev), 1, t.Ev, pt2,
                    2 * t.br, ot, t.br);
  }
};

inline void forward_tile_bf16(const FlashForwardTile& t) {
  uint16_t* pt2 = reinterpret_cast<uint16_t*>(t.scratch + flash_forward_scratch(t.E, t.Ev, t.br));
  forward_tile_with(t, Bf16Products{t, pt2});
}
#endif

// Few query rows (FlashDecodeRows, and their backward): per row, raw scores
// s_j = q·k_j (dot products along E, reduced lane by lane: the forward and
// the backward by rows compute each the same way, as P recovered from the
// saved lse needs at huge logits), then the softmax across keys as the tile
// kernel's (logits s·c + mask·log2 e, base 2, the max held at -FLT_MAX or
// above), then o = Σ_j p_j v_j / l.

// W entries of a float32 or a bfloat16 row (its bits) as floats; lanes past n read 0.
inline Vec row_part(const float* row, int64_t e0, int64_t n) {
  return e0 + W <= n ? Vec::load(row + e0) : Vec::load_partial(row + e0, int(n - e0));
}
inline Vec row_part(const uint16_t* row, int64_t e0, int64_t n) {
  return e0 + W <= n ? Vec::load_bf16(row + e0) : Vec::load_bf16_partial(row + e0, int(n - e0));
}

// s[j] (j in [lo, hi)) = x · row j of m (rows m_row apart, n entries each,
// float32 or bfloat16; x zero padded to whole vectors), four rows at a time,
// their sums reduced together. A last group of fewer than four repeats its
// last row: every s[j] comes out of the same sums whichever group it falls
// in, so the backward by rows, whose key ranges start elsewhere, recovers
// the forward's P exactly.
template <class T>
inline void row_dots(const float* x, const T* m, int64_t m_row, int64_t n, int64_t lo, int64_t hi, float* s) {
  for (int64_t j = lo; j < hi; j += 4) {
    const T* rows[4];
    for (int u = 0; u < 4; ++u) rows[u] = m + min64(j + u, hi - 1) * m_row;
    Vec acc[4] = {Vec::zero(), Vec::zero(), Vec::zero(), Vec::zero()};
    for (int64_t e0 = 0; e0 < n; e0 += W) {
      const Vec xv = Vec::load(x + e0);
      for (int u = 0; u < 4; ++u) acc[u] = fma(xv, row_part(rows[u], e0, n), acc[u]);
    }
    float sums[4];
    reduce_add4(acc, sums);
    for (int64_t u = 0; u < min64(4, hi - j); ++u) s[j + u] = sums[u];
  }
}

inline Vec row_vec(const float* p) { return Vec::load(p); }
inline Vec row_vec(const uint16_t* p) { return Vec::load_bf16(p); }

// o[e0 …] = scale · Σ_j p[j] · row j of `values` (rows v_row apart), V
// vectors of it; with `partial`, one vector of `lanes` lanes. Keys alternate
// between two sets of accumulators where V ≤ 4, so that at least eight FMA
// chains hide the FMA's latency; all in registers (a loop over a run-time
// count of vectors kept them on the stack: a load and a store around every
// FMA).
template <int V, bool partial, class T>
inline void weighted_rows(const float* p, const T* values, int64_t v_row, int64_t lo, int64_t hi, int64_t e0,
                          int lanes, Vec scale, float* o) {
  static_assert(V == 1 || !partial);
  constexpr int kSets = V <= 4 ? 2 : 1;
  const auto part = [&](const T* row, int u) {
    if constexpr (partial) return row_part(row, e0, e0 + lanes);
    else return row_vec(row + e0 + u * W);
  };
  Vec acc[kSets][V];
  MHA_UNROLL for (int t = 0; t < kSets; ++t)
    MHA_UNROLL for (int u = 0; u < V; ++u) acc[t][u] = Vec::zero();
  int64_t j = lo;
  for (; j + kSets <= hi; j += kSets)
    MHA_UNROLL for (int t = 0; t < kSets; ++t) {
      const Vec pj = Vec::set1(p[j + t]);
      const T* row = values + (j + t) * v_row;
      MHA_UNROLL for (int u = 0; u < V; ++u) acc[t][u] = fma(pj, part(row, u), acc[t][u]);
    }
  for (; j < hi; ++j) {
    const Vec pj = Vec::set1(p[j]);
    MHA_UNROLL for (int u = 0; u < V; ++u) acc[0][u] = fma(pj, part(values + j * v_row, u), acc[0][u]);
  }
  MHA_UNROLL for (int u = 0; u < V; ++u) {
    const Vec x = (kSets == 2 ? acc[0][u] + acc[kSets - 1][u] : acc[0][u]) * scale;
    if constexpr (partial) x.store_partial(o + e0, lanes);
    else x.store(o + e0 + u * W);
  }
}

// Raw scores of keys [lo, hi) into logits as finish_scores makes them (with a
// mask, s·c + mask·log2e and multiplier 1; without, s and multiplier c),
// rounded as it rounds them (the backward's P relies on it). mask: the row's.
inline float row_logits(float* s, int64_t lo, int64_t hi, float c, const float* mask, int64_t mask_col) {
  if (mask) {
    const Vec cv = Vec::set1(c);
    for (int64_t j = lo; j < hi; j += W) (Vec::load(s + j) * cv).store(s + j);
    for (int64_t j = lo; j < hi; ++j) s[j] += mask[j * mask_col] * kLog2e;
  }
  return logit_multiplier(mask, c);
}

// x (n, zero padded to whole vectors) = row of n floats.
inline void padded_row(const float* row, int64_t n, float* x) {
  const int64_t padded = (n + W - 1) / W * W;
  for (int64_t e = 0; e < padded; ++e) x[e] = e < n ? row[e] : 0.0f;
}

// K and V as T (float or the bits of bfloat16), rows d.k_row and d.v_row apart.
template <class T>
inline void decode_rows_of(const FlashDecodeRows& d, const T* keys, const T* values) {
  float* s = d.scratch;                          // (S + W): scores, then probabilities; -inf past the band
  float* qs = s + (d.S + W + 63) / 64 * 64;      // (E to a multiple of W): the query, zero padded
  for (int64_t i = 0; i < d.rows; ++i) {
    const int64_t query = d.i0 + i;
    const int64_t lo = max64(0, query + d.band.lo_shift), hi = min64(d.S, query + d.band.hi_shift);
    if (lo >= hi) {  // no key in the band (which may lie past either end): out 0, lse -inf
      for (int64_t e = 0; e < d.Ev; ++e) d.out[i * d.out_row + e] = 0.0f;
      d.lse[i] = -__builtin_inff();
      continue;
    }
    padded_row(d.q + i * d.q_row, d.E, qs);
    row_dots(qs, keys, d.k_row, d.E, lo, hi, s);
    const float multiplier = row_logits(s, lo, hi, d.logit_scale, d.mask ? d.mask + i * d.mask_row : nullptr, d.mask_col);
    int64_t j;
    for (j = hi; j < hi + W; ++j) s[j] = -__builtin_inff();  // whole vectors past the band: p = 0
    // The max across the band (a raw max when the multiplier is c > 0), a
    // lane each, NaN passed over (max keeps its second operand), then p and l.
    Vec lane_max = Vec::set1(-__builtin_inff());
    for (j = lo; j < hi; j += W) lane_max = max(Vec::load(s + j), lane_max);
    float lanes[W];
    lane_max.store(lanes);
    float raw_max = -__builtin_inff();
    for (int u = 0; u < W; ++u) raw_max = lanes[u] > raw_max ? lanes[u] : raw_max;
    const float m = raw_max * multiplier > -3.402823466e38f ? raw_max * multiplier : -3.402823466e38f;
    const Vec c = Vec::set1(multiplier), neg_m = Vec::set1(-m);
    Vec sum = Vec::zero();
    for (j = lo; j < hi; j += W) {
      const Vec p = exp2(fma(Vec::load(s + j), c, neg_m));
      sum = sum + p;
      p.store(s + j);
    }
    const float l = reduce_add(sum);  // NaN where a score was (a NaN row)
    const float inv = l == 0.0f ? 0.0f : 1.0f / l;
    float* o = d.out + i * d.out_row;
    // The output by 8, 4, 2 and 1 whole vectors, then a partial one.
    const Vec scale = Vec::set1(inv);
    const int64_t v_row = d.v_row, Ev = d.Ev;
    int64_t e0 = 0;
    for (; e0 + 8 * W <= Ev; e0 += 8 * W) weighted_rows<8, false>(s, values, v_row, lo, hi, e0, W, scale, o);
    if (e0 + 4 * W <= Ev) weighted_rows<4, false>(s, values, v_row, lo, hi, e0, W, scale, o), e0 += 4 * W;
    if (e0 + 2 * W <= Ev) weighted_rows<2, false>(s, values, v_row, lo, hi, e0, W, scale, o), e0 += 2 * W;
    if (e0 + W <= Ev) weighted_rows<1, false>(s, values, v_row, lo, hi, e0, W, scale, o), e0 += W;
    if (e0 < Ev) weighted_rows<1, true>(s, values, v_row, lo, hi, e0, int(Ev - e0), scale, o);
    bool any_key = true;
    if (l == 0.0f && d.mask) {
      any_key = false;
      for (j = lo; j < hi && !any_key; ++j) any_key = d.mask[i * d.mask_row + j * d.mask_col] != -__builtin_inff();
    }
    d.lse[i] = l == 0.0f ? (any_key ? __builtin_nanf("") : -__builtin_inff()) : (m + __builtin_log2f(l)) * kLn2;
  }
}

inline void decode_rows(const FlashDecodeRows& d) {
  if (d.k16) decode_rows_of(d, d.k16, d.v16);
  else decode_rows_of(d, d.k, d.v);
}

// The backward of a few query rows (the forward by rows'), for the queries
// and keys of h's ranges: P from the saved lse as the tile backward does, dP
// and the scores as dot products along E, then dQ += dS·K over the keys and,
// over the queries in order, dK += dS_Tᵀ·Q and dV += P_Tᵀ·dO. No dropout.
inline void backward_rows(const FlashBackwardHead& h) {
  const int64_t k_end = min64(h.S, h.key_end), q_end = min64(h.L, h.query_end);
  float* s = h.scratch;                           // (S + W): scores, then P
  float* dp = s + (h.S + W + 63) / 64 * 64;       // (S + W): dP, then dS·scale
  float* qs = dp + (h.S + W + 63) / 64 * 64;      // (E_pad): the query
  float* ds = qs + h.E_pad;                       // (Ev_pad): dO's row
  if (h.want_dkdv)
    for (int64_t j = h.key_begin; j < k_end; ++j) {
      for (int64_t e = 0; e < h.E; ++e) h.dk[j * h.dk_row + e] = 0.0f;
      for (int64_t e = 0; e < h.Ev; ++e) h.dv[j * h.dv_row + e] = 0.0f;
    }
  const Vec scale = Vec::set1(h.scale);
  for (int64_t i = h.query_begin; i < q_end; ++i) {
    const int64_t lo = max64(h.key_begin, max64(0, i + h.band.lo_shift));
    const int64_t hi = min64(k_end, i + h.band.hi_shift);
    if (lo >= hi) continue;
    padded_row(h.q + i * h.q_row, h.E, qs);
    padded_row(h.dout + i * h.dout_row, h.Ev, ds);
    row_dots(qs, h.k, h.k_row, h.E, lo, hi, s);
    const Vec c = Vec::set1(row_logits(s, lo, hi, h.logit_scale, h.mask ? h.mask + i * h.mask_row : nullptr, h.mask_col));
    row_dots(ds, h.v, h.v_row, h.Ev, lo, hi, dp);
    const Vec lse2 = Vec::set1(h.lse2[i]), delta = Vec::set1(h.delta[i]);
    for (int64_t j = lo; j < hi; j += W) {  // whole vectors: the lanes past hi are never read
      const Vec p = probability(Vec::load(s + j), c, lse2);
      p.store(s + j);
      ((p * scale) * (Vec::load(dp + j) - delta)).store(dp + j);
    }
    if (h.want_dq) {  // dQ_i += Σ_j dS_ij K_j (E_pad columns, as the tile kernel)
      float* dq = h.dq + i * h.dq_row;
      for (int64_t e0 = 0; e0 < h.E_pad; e0 += W) {
        Vec acc = Vec::load(dq + e0);
        for (int64_t j = lo; j < hi; ++j) acc = fma(Vec::set1(dp[j]), Vec::load(h.k + j * h.k_row + e0), acc);
        acc.store(dq + e0);
      }
    }
    if (!h.want_dkdv) continue;
    // dK_j += dS_ij Q_i, dV_j += P_ij dO_i: row (n floats) += a · x (x zero padded).
    const auto add_scaled = [](float* row, int64_t n, float a, const float* x) {
      for (int64_t e0 = 0; e0 < n; e0 += W) {
        const int here = int(min64(W, n - e0));
        const Vec y = fma(Vec::set1(a), Vec::load(x + e0), here == W ? Vec::load(row + e0) : Vec::load_partial(row + e0, here));
        if (here == W) y.store(row + e0);
        else y.store_partial(row + e0, here);
      }
    };
    for (int64_t j = lo; j < hi; ++j) {
      add_scaled(h.dk + j * h.dk_row, h.E, dp[j], qs);
      add_scaled(h.dv + j * h.dv_row, h.Ev, s[j], ds);
    }
  }
}

// The backward's five products on float32 operands.
struct FloatBackwardProducts {
  const FlashBackwardHead& h;
  // S_T (cols × br) = K[j0 …] · Q_T of query tile `tile`.
  void scores(int64_t j0, int64_t cols, int64_t tile, float* st) const {
    gemm<false>(cols, h.br, h.E, h.k + j0 * h.k_row, h.k_row, 1, h.qt + tile * h.E * h.br, h.br, st, h.br);
  }
  // dP_T (cols × br) = V[j0 …] · dO_T of query tile `tile`. Each product
  // brings `ahead` into L2 as it goes (backward_head_with).
  void dprobs(int64_t j0, int64_t cols, int64_t tile, float* dpt, const Ahead& ahead) const {
    gemm<false>(cols, h.br, h.Ev, h.v + j0 * h.v_row, h.v_row, 1, h.dot + tile * h.Ev * h.br, h.br, dpt, h.br, ahead);
  }
  // dV (cols × Ev_pad) += (P∘F)_T · dO_tile;  dK (cols × E_pad) += (dS·scale)_T · Q_tile.
  void key_gradients(int64_t cols, int64_t i0, int64_t rows, const float* pdrop, const float* dst, float* dk_acc,
                     float* dv_acc, const Ahead& ahead) const {
    gemm<true>(cols, h.Ev_pad, rows, pdrop, h.br, 1, h.dout + i0 * h.dout_row, h.dout_row, dv_acc, h.Ev_pad,
               part(ahead, 0, 1, 2));
    gemm<true>(cols, h.E_pad, rows, dst, h.br, 1, h.q + i0 * h.q_row, h.q_row, dk_acc, h.E_pad, part(ahead, 1, 2, 2));
  }
  // dQ_tile (rows × E_pad) += (dS·scale) · K_tile: A(i, j) = dS_T[j][i].
  void query_gradient(int64_t j0, int64_t cols, int64_t i0, int64_t rows, const float* dst, const Ahead& ahead) const {
    gemm<true>(rows, h.E_pad, cols, dst, 1, h.br, h.k + j0 * h.k_row, h.k_row, h.dq + i0 * h.dq_row, h.dq_row,
               ahead);
  }
};

// The kept scores of key tile [j0, j0 + cols) for the query tile at i0, and
// how many of its keys the forward finished (`kept`).
inline const float* kept_tile(const FlashBackwardHead& h, int64_t j0, int64_t cols, int64_t i0, int64_t& kept) {
  int64_t lo, hi;
  key_range(i0, min64(h.br, h.L - i0), h.S, h.band, lo, hi);
  kept = max64(0, min64(cols, hi - j0));
  return h.scores + h.score_tiles[i0 / h.br] * kFlashKeyTile * h.br + j0 * h.br;
}

template <class Products>
void backward_head_with(const FlashBackwardHead& h, const Products& products) {
  const int64_t br = h.br, nv = br / W;
  float* st = h.scratch;                         // (Bc, br): scores, then P
  float* dst = st + kFlashKeyTile * br;          // (Bc, br): dP, then dS·scale
  float* pdrop = dst + kFlashKeyTile * br;       // (Bc, br): P∘F
  float* factors = pdrop + kFlashKeyTile * br;   // (Bc, br)
  float* dk_acc = factors + kFlashKeyTile * br;  // (Bc, E_pad)
  float* dv_acc = dk_acc + kFlashKeyTile * h.E_pad;  // (Bc, Ev_pad)
  const bool drop = h.dropout.fill != nullptr;
  const Vec scale = Vec::set1(h.scale);

  for (int64_t j0 = h.key_begin; j0 < min64(h.S, h.key_end); j0 += kFlashKeyTile) {
    const int64_t cols = min64(kFlashKeyTile, h.S - j0);
    if (h.want_dkdv) {
      for (int64_t x = 0; x < cols * h.E_pad; ++x) dk_acc[x] = 0.0f;
      for (int64_t x = 0; x < cols * h.Ev_pad; ++x) dv_acc[x] = 0.0f;
    }
    // Queries that see any key of [j0, j0+cols): j >= i + lo and j < i + hi.
    const int64_t q_lo = max64(h.query_begin, j0 - h.band.hi_shift + 1);
    const int64_t q_hi = min64(min64(h.L, h.query_end), j0 + cols - h.band.lo_shift);
    for (int64_t i0 = q_lo / br * br; i0 < q_hi; i0 += br) {
      const int64_t rows = min64(br, h.L - i0), tile = i0 / br;
      // Kept scores: the forward finished the tile's keys up to its band's end
      // (`kept` of them here); the keys past it are outside every row's band, P = 0.
      const float* s = st;
      int64_t kept = cols;
      // The next query tile's kept scores (next_lines lines at `next`), for
      // this tile's products to bring into L2, a share before each micro-tile
      // (Ahead). Asked for as each tile began, 256 lines from memory at once,
      // the prefetches waited for line-fill buffers: 46% of this function's
      // own cycles at (8, 2039, 64) causal (AVX-512 Xeon, 2 threads; backward
      // 35.7 -> 34.4 ms asked for a line with each iteration of the softmax
      // loop below, AVX2 code 55.2 -> 54.3). That loop's 3-4k cycles still
      // sent them out in a burst; spread over the products' 40-45k: 35.5 ->
      // 34.4 ms (medians of ten alternating runs), AVX2 code even.
      const float* next = nullptr;
      int64_t next_lines = 0;
      Vec c;
      if (h.scores) {
        s = kept_tile(h, j0, cols, i0, kept);
        c = Vec::set1(logit_multiplier(h.mask, h.logit_scale));
        // Into L1 while dP's product runs: from L2 where the previous tile's
        // loop fetched them, else from memory.
        for (int64_t x = 0; x < kept * br; x += kLineFloats) __builtin_prefetch(s + x, 0, 3);
        if (i0 + br < q_hi) {
          int64_t next_kept;
          next = kept_tile(h, j0, cols, i0 + br, next_kept);
          next_lines = next_kept * br / kLineFloats;
        }
      } else {
        products.scores(j0, cols, tile, st);
        c = Vec::set1(finish_scores(st, br, h.logit_scale, i0, rows, j0, cols, h.band,
                                    h.mask ? h.mask + i0 * h.mask_row : nullptr, h.mask_row, h.mask_col));
      }
      // Shares of those lines: one for dP's product, two for dK's and dV's, one for dQ's.
      const int64_t parts = 1 + (h.want_dkdv ? 2 : 0) + (h.want_dq ? 1 : 0);
      const Ahead ahead{next, next_lines};
      products.dprobs(j0, cols, tile, dst, part(ahead, 0, 1, parts));
      if (drop) h.dropout.fill(h.dropout.ctx, i0, rows, j0, cols, factors, br);
      for (int64_t v = 0; v < nv; ++v) {
        const Vec lse2 = Vec::load(h.lse2 + i0 + v * W), delta = Vec::load(h.delta + i0 + v * W);
        for (int64_t j = 0; j < cols; ++j) {
          const Vec p = j < kept ? probability(Vec::load(s + j * br + v * W), c, lse2) : Vec::zero();
          Vec dp = Vec::load(dst + j * br + v * W);
          Vec pd = p;
          if (drop) {
            const Vec f = Vec::load(factors + j * br + v * W);
            pd = p * f;
            dp = dp * f;
          }
          pd.store(pdrop + j * br + v * W);
          ((p * scale) * (dp - delta)).store(dst + j * br + v * W);  // dS_T · scale
        }
      }
      if (h.want_dkdv) products.key_gradients(cols, i0, rows, pdrop, dst, dk_acc, dv_acc, part(ahead, 1, 3, parts));
      if (h.want_dq) products.query_gradient(j0, cols, i0, rows, dst, part(ahead, parts - 1, parts, parts));
    }
    if (!h.want_dkdv) continue;
    for (int64_t j = 0; j < cols; ++j) {
      for (int64_t e = 0; e < h.E; ++e) h.dk[(j0 + j) * h.dk_row + e] = dk_acc[j * h.E_pad + e];
      for (int64_t e = 0; e < h.Ev; ++e) h.dv[(j0 + j) * h.dv_row + e] = dv_acc[j * h.Ev_pad + e];
    }
  }
}

inline void backward_head(const FlashBackwardHead& h) { backward_head_with(h, FloatBackwardProducts{h}); }

#if defined(MHA_SIMD_AVX512)
// The backward's products on bfloat16 operands (vdpbf16ps), P∘F and dS·scale
// rounded to bfloat16 as the forward rounds P: S_T and dP_T reduce over E
// (key and value rows against query and dO pairs along e, as the forward's
// scores), dV and dK over the tile's queries (rows of P_T and dS_T read as
// query pairs, against dO and Q in query pairs), dQ over the keys (dS_T's
// rows interleaved in key pairs, against K in key pairs).
struct Bf16BackwardProducts {
  const FlashBackwardHead& h;
  uint16_t* p16;   // (Bc, br): P∘F rounded
  uint16_t* ds16;  // (Bc, br): dS·scale rounded
  uint16_t* ds2;   // (Bc/2, br, 2): dS·scale rounded, in key pairs

  void scores(int64_t j0, int64_t cols, int64_t tile, float* st) const {
    const int64_t e2 = (h.E + 1) / 2;
    gemm_bf16<false>(cols, h.br, e2, reinterpret_cast<const uint32_t*>(h.k16 + j0 * h.k16_row), h.k16_row / 2, 1,
                     h.qt2 + tile * e2 * h.br * 2, 2 * h.br, st, h.br);
  }
  // (No kept scores with bfloat16 products, so nothing `ahead`.)
  void dprobs(int64_t j0, int64_t cols, int64_t tile, float* dpt, const Ahead&) const {
    const int64_t ev2 = (h.Ev + 1) / 2;
    gemm_bf16<false>(cols, h.br, ev2, reinterpret_cast<const uint32_t*>(h.v16 + j0 * h.v16_row), h.v16_row / 2, 1,
                     h.dot2 + tile * ev2 * h.br * 2, 2 * h.br, dpt, h.br);
  }
  void key_gradients(int64_t cols, int64_t i0, int64_t rows, const float* pdrop, const float* dst, float* dk_acc,
                     float* dv_acc, const Ahead&) const {
    round_rows(pdrop, cols, h.br, p16, h.br);
    round_rows(dst, cols, h.br, ds16, h.br);
    const int64_t pairs = (rows + 1) / 2;  // an odd tile's last pair meets a pad query: P = dS = 0 there
    gemm_bf16<true>(cols, h.Ev_pad, pairs, reinterpret_cast<const uint32_t*>(p16), h.br / 2, 1,
                    h.dout2 + i0 * h.Ev_pad, 2 * h.Ev_pad, dv_acc, h.Ev_pad);
    gemm_bf16<true>(cols, h.E_pad, pairs, reinterpret_cast<const uint32_t*>(ds16), h.br / 2, 1,
                    h.q2 + i0 * h.E_pad, 2 * h.E_pad, dk_acc, h.E_pad);
  }
  void query_gradient(int64_t j0, int64_t cols, int64_t i0, int64_t rows, const float* dst, const Ahead&) const {
    pairs_along_keys(dst, h.br, cols, ds2);
    gemm_bf16<true>(rows, h.E_pad, (cols + 1) / 2, reinterpret_cast<const uint32_t*>(ds2), 1, h.br,
                    h.k2 + j0 * h.E_pad, 2 * h.E_pad, h.dq + i0 * h.dq_row, h.dq_row);
  }
};

inline void backward_head_bf16(const FlashBackwardHead& h) {
  uint16_t* p16 = reinterpret_cast<uint16_t*>(h.scratch + flash_backward_scratch(h.E_pad, h.Ev_pad, h.br));
  uint16_t* ds16 = p16 + kFlashKeyTile * h.br;
  backward_head_with(h, Bf16BackwardProducts{h, p16, ds16, ds16 + kFlashKeyTile * h.br});
}
#endif

}  // namespace mha::cpu::MHA_ISA_NAMESPACE
