// Feature-map attention for one batch entry: the non-causal form as four
// matrix products, the causal form as chunked prefix (forward) and suffix
// (backward) sweeps, one segment of chunks per thread.
//
// Notation: W = Ev + 1 columns of V̂ = [V, 1], so that one product gives the
// numerators and the normaliser together; Ĝ = [dout / den, -(dout·out) / den]
// is the gradient of those W columns.
#include "variants/feature_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/parallel.h"
#include "finite.h"

namespace mha::variants {

namespace {

// Rows per chunk of the causal form. Within a chunk the causal products are
// dense C × C blocks (C·(F + W) flops per row); across chunks one state
// product (F·W per row). C = 64 keeps both of the same order for F ≈ W ≈ 64
// and the C × C scratch in L1/L2.
constexpr int64_t kChunk = 64;

template <class T>
Buffer<T> augmented(const T* v, int64_t S, int64_t Ev) {
  Buffer<T> out(S * (Ev + 1));
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < S; ++j) {
    std::copy(v + j * Ev, v + (j + 1) * Ev, out.data() + j * (Ev + 1));
    out[j * (Ev + 1) + Ev] = T(1);
  }
  return out;
}

// Chunks [0, chunks) cut into `count` contiguous segments, one per thread.
struct Segments {
  int64_t rows, chunks, count;

  explicit Segments(int64_t L)
      : rows(L), chunks((L + kChunk - 1) / kChunk), count(std::min<int64_t>(omp_get_max_threads(), chunks)) {}
  int64_t first_chunk(int64_t s) const { return s * chunks / count; }
  int64_t first_row(int64_t s) const { return std::min(rows, first_chunk(s) * kChunk); }
};

// starts[s] (F × W each) = Σ of a_iᵀ b_i (a: F wide, b: W wide) over the rows of
// the segments before s (prefix) or after s (suffix).
template <class T>
std::vector<T> segment_starts(const Segments& seg, const T* a, const T* b, int64_t F, int64_t W, bool suffix) {
  const size_t block = size_t(F * W);
  std::vector<T> starts(size_t(seg.count) * block), total(block, T(0));
  cpu::RegionErrors errors;  // a product's scratch may be refused (cpu/parallel.h)
#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < seg.count; ++s) errors.run([&] {
    const int64_t r0 = seg.first_row(s), r1 = seg.first_row(s + 1);
    cpu::gemm<T>(true, false, F, W, r1 - r0, T(1), a + r0 * F, F, b + r0 * W, W, T(0), &starts[size_t(s) * block], W);
  });
  errors.rethrow();
  for (int64_t x = 0; x < seg.count; ++x) {  // exclusive scan, in place
    T* here = &starts[size_t(suffix ? seg.count - 1 - x : x) * block];
    for (size_t e = 0; e < block; ++e) std::swap(here[e], total[e]), total[e] += here[e];
  }
  return starts;
}

// tril(a_c b_cᵀ) for the n rows of one chunk (a, b: `width` wide) into t (n × n, ld kChunk).
template <class T>
void lower_product(const T* a, const T* b, int64_t n, int64_t width, T* t) {
  cpu::gemm<T>(false, true, n, n, width, T(1), a, width, b, width, T(0), t, kChunk);
  for (int64_t r = 0; r < n; ++r) std::fill(t + r * kChunk + r + 1, t + r * kChunk + n, T(0));
}

template <class T>
T tiny_normalizer() {
  return std::sqrt(std::numeric_limits<T>::min());
}


// The dense definition, key by key, for inputs that hold a NaN or infinity.
// The fast forms multiply the causally excluded entries of a chunk as 0
// (0·NaN = NaN) and so cannot say which rows depend on a non-finite input;
// here only the keys a row sees are read, so a NaN reaches exactly the rows
// and gradients whose formula reads it. O(L·S·(F + Ev)).
template <class T>
void dense_forward(const FeatureAttentionShape& n, const T* pq, const T* pk, const T* v, T* out, T* normalizer) {
  const T tiny = tiny_normalizer<T>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n.L; ++i) {
    T den = 0;
    T* o = out + i * n.Ev;
    std::fill(o, o + n.Ev, T(0));
    for (int64_t j = 0; j < (n.causal ? i + 1 : n.S); ++j) {
      const T a = dot(pq + i * n.F, pk + j * n.F, n.F);
      den += a;
      for (int64_t e = 0; e < n.Ev; ++e) o[e] += a * v[j * n.Ev + e];
    }
    if (den <= tiny) den = 0;
    for (int64_t e = 0; e < n.Ev; ++e) o[e] = den == T(0) ? T(0) : o[e] / den;
    normalizer[i] = den;
  }
}

// With a_ij = φq_i·φk_j, out_i = Σ_j a_ij v_j / Σ_j a_ij:
//   ∂L/∂a_ij = (dout_i·v_j - dout_i·out_i) / den_i,
//   dφq_i = Σ_j ∂a_ij φk_j,  dφk_j = Σ_i ∂a_ij φq_i,  dv_j = Σ_i a_ij dout_i / den_i.
// Serial over rows (the sums over i meet in dφk and dv); only for non-finite inputs.
template <class T>
void dense_backward(const FeatureAttentionShape& n, const T* pq, const T* pk, const T* v, const T* out,
                    const T* normalizer, const T* dout, T* dpq, T* dpk, T* dv) {
  std::fill(dpq, dpq + n.L * n.F, T(0));
  std::fill(dpk, dpk + n.S * n.F, T(0));
  std::fill(dv, dv + n.S * n.Ev, T(0));
  for (int64_t i = 0; i < n.L; ++i) {
    const T den = normalizer[i];
    if (den == T(0)) continue;  // an underflowed row: zero gradient
    const T* d = dout + i * n.Ev;
    const T d_out = dot(d, out + i * n.Ev, n.Ev);
    for (int64_t j = 0; j < (n.causal ? i + 1 : n.S); ++j) {
      const T a = dot(pq + i * n.F, pk + j * n.F, n.F);
      const T da = (dot(d, v + j * n.Ev, n.Ev) - d_out) / den;
      for (int64_t f = 0; f < n.F; ++f) {
        dpq[i * n.F + f] += da * pk[j * n.F + f];
        dpk[j * n.F + f] += da * pq[i * n.F + f];
      }
      for (int64_t e = 0; e < n.Ev; ++e) dv[j * n.Ev + e] += a * d[e] / den;
    }
  }
}

template <class T>
void causal_backward(const FeatureAttentionShape& n, const T* pq, const T* pk, const Buffer<T>& vhat,
                     const Buffer<T>& ghat, T* dpq, T* dpk, T* dv) {
  const int64_t L = n.L, F = n.F, Ev = n.Ev, W = Ev + 1;
  const Segments seg(L);
  std::vector<T> prefix = segment_starts(seg, pk, vhat.data(), F, W, false);   // Û before each segment
  std::vector<T> suffix = segment_starts(seg, pq, ghat.data(), F, W, true);    // R after each segment
  cpu::RegionErrors errors;
#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < seg.count; ++s) errors.run([&] {
    std::vector<T> t(static_cast<size_t>(kChunk * kChunk));
    T* state = &prefix[size_t(s * F * W)];
    for (int64_t c = seg.first_chunk(s); c < seg.first_chunk(s + 1); ++c) {  // dφq_c = tril(Ĝ_c V̂_cᵀ) φk_c + Ĝ_c Ûᵀ
      const int64_t i0 = c * kChunk, rows = std::min(kChunk, L - i0);
      const T* g = ghat.data() + i0 * W;
      const T* vh = vhat.data() + i0 * W;
      lower_product(g, vh, rows, W, t.data());
      cpu::gemm<T>(false, false, rows, F, rows, T(1), t.data(), kChunk, pk + i0 * F, F, T(0), dpq + i0 * F, F);
      cpu::gemm<T>(false, true, rows, F, W, T(1), g, W, state, W, T(1), dpq + i0 * F, F);
      cpu::gemm<T>(true, false, F, W, rows, T(1), pk + i0 * F, F, vh, W, T(1), state, W);
    }
    T* r = &suffix[size_t(s * F * W)];
    for (int64_t c = seg.first_chunk(s + 1) - 1; c >= seg.first_chunk(s); --c) {
      const int64_t i0 = c * kChunk, rows = std::min(kChunk, L - i0);
      const T* g = ghat.data() + i0 * W;
      const T* vh = vhat.data() + i0 * W;
      // dφk_c = tril(Ĝ_c V̂_cᵀ)ᵀ φq_c + V̂_c Rᵀ
      lower_product(g, vh, rows, W, t.data());
      cpu::gemm<T>(true, false, rows, F, rows, T(1), t.data(), kChunk, pq + i0 * F, F, T(0), dpk + i0 * F, F);
      cpu::gemm<T>(false, true, rows, F, W, T(1), vh, W, r, W, T(1), dpk + i0 * F, F);
      // dV_c = tril(φq_c φk_cᵀ)ᵀ Ĝ_c[:, :Ev] + φk_c R[:, :Ev]
      lower_product(pq + i0 * F, pk + i0 * F, rows, F, t.data());
      cpu::gemm<T>(true, false, rows, Ev, rows, T(1), t.data(), kChunk, g, W, T(0), dv + i0 * Ev, Ev);
      cpu::gemm<T>(false, false, rows, Ev, F, T(1), pk + i0 * F, F, r, W, T(1), dv + i0 * Ev, Ev);
      cpu::gemm<T>(true, false, F, W, rows, T(1), pq + i0 * F, F, g, W, T(1), r, W);
    }
  });
  errors.rethrow();
}

}  // namespace

QkvSizes check_feature_call(const Tensor& query, const Tensor& key, const Tensor& value, bool causal,
                            const std::string& fn) {
  const QkvSizes n = check_qkv(query, key, value, fn);
  if (causal && n.L != n.S)
    raise<ShapeError>(fn, "key", "S = L = " + std::to_string(n.L) + " for causal attention", shape_string(key.shape()));
  return n;
}

template <class T>
void feature_attention_forward(const FeatureAttentionShape& n, const T* pq, const T* pk, const T* v, T* out,
                               T* normalizer) {
  const int64_t L = n.L, S = n.S, F = n.F, Ev = n.Ev, W = Ev + 1;
  const Buffer<T> vhat = augmented(v, S, Ev);
  Buffer<T> num(L * W);
  if (!n.causal) {
    std::vector<T> state(static_cast<size_t>(F * W));  // Û = Σ_j φk_j v̂_jᵀ
    cpu::gemm<T>(true, false, F, W, S, T(1), pk, F, vhat.data(), W, T(0), state.data(), W);
    cpu::gemm<T>(false, false, L, W, F, T(1), pq, F, state.data(), W, T(0), num.data(), W);
  } else {
    const Segments seg(L);
    std::vector<T> starts = segment_starts(seg, pk, vhat.data(), F, W, false);
    cpu::RegionErrors errors;
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < seg.count; ++s) errors.run([&] {
      T* state = &starts[size_t(s * F * W)];  // Û before the chunk, updated after each
      std::vector<T> a(static_cast<size_t>(kChunk * kChunk));
      for (int64_t c = seg.first_chunk(s); c < seg.first_chunk(s + 1); ++c) {
        const int64_t i0 = c * kChunk, rows = std::min(kChunk, L - i0);
        lower_product(pq + i0 * F, pk + i0 * F, rows, F, a.data());
        cpu::gemm<T>(false, false, rows, W, rows, T(1), a.data(), kChunk, vhat.data() + i0 * W, W, T(0), num.data() + i0 * W, W);
        cpu::gemm<T>(false, false, rows, W, F, T(1), pq + i0 * F, F, state, W, T(1), num.data() + i0 * W, W);
        cpu::gemm<T>(true, false, F, W, rows, T(1), pk + i0 * F, F, vhat.data() + i0 * W, W, T(1), state, W);
      }
    });
    errors.rethrow();
  }
  // Below √(smallest normal) a normaliser counts as underflowed: 1/den would
  // overflow in backward (Ĝ and the sums of R), so such rows are set to 0.
  const T tiny = tiny_normalizer<T>();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < L; ++i) {
    const T* row = num.data() + i * W;
    const T den = row[Ev] <= tiny ? T(0) : row[Ev];  // a NaN stays NaN
    for (int64_t e = 0; e < Ev; ++e) out[i * Ev + e] = den == T(0) ? T(0) : row[e] / den;
    normalizer[i] = den;
  }
  if (!all_finite(out, L * Ev) || !all_finite(normalizer, L)) dense_forward(n, pq, pk, v, out, normalizer);
}

template <class T>
void feature_attention_backward(const FeatureAttentionShape& n, const T* pq, const T* pk, const T* v, const T* out,
                                const T* normalizer, const T* dout, T* dpq, T* dpk, T* dv) {
  const int64_t L = n.L, S = n.S, F = n.F, Ev = n.Ev, W = Ev + 1;
  const Buffer<T> vhat = augmented(v, S, Ev);
  Buffer<T> ghat(L * W);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < L; ++i) {
    const T den = normalizer[i];
    T* g = ghat.data() + i * W;
    T dot = 0;
    for (int64_t e = 0; e < Ev; ++e) {
      g[e] = den == T(0) ? T(0) : dout[i * Ev + e] / den;
      dot += dout[i * Ev + e] * out[i * Ev + e];
    }
    g[Ev] = den == T(0) ? T(0) : -dot / den;
  }
  if (!n.causal) {
    std::vector<T> state(static_cast<size_t>(F * W)), r(static_cast<size_t>(F * W));
    cpu::gemm<T>(true, false, F, W, S, T(1), pk, F, vhat.data(), W, T(0), state.data(), W);    // Û
    cpu::gemm<T>(false, true, L, F, W, T(1), ghat.data(), W, state.data(), W, T(0), dpq, F);   // dφq = Ĝ Ûᵀ
    cpu::gemm<T>(true, false, F, W, L, T(1), pq, F, ghat.data(), W, T(0), r.data(), W);        // R = φqᵀ Ĝ
    cpu::gemm<T>(false, true, S, F, W, T(1), vhat.data(), W, r.data(), W, T(0), dpk, F);       // dφk = V̂ Rᵀ
    cpu::gemm<T>(false, false, S, Ev, F, T(1), pk, F, r.data(), W, T(0), dv, Ev);              // dV = φk R[:, :Ev]
  } else {
    causal_backward(n, pq, pk, vhat, ghat, dpq, dpk, dv);
  }
  if (!all_finite(dpq, L * F) || !all_finite(dpk, S * F) || !all_finite(dv, S * Ev))
    dense_backward(n, pq, pk, v, out, normalizer, dout, dpq, dpk, dv);
}


#define MHA_INSTANTIATE(T)                                                                                        \
  template void feature_attention_forward<T>(const FeatureAttentionShape&, const T*, const T*, const T*, T*, T*); \
  template void feature_attention_backward<T>(const FeatureAttentionShape&, const T*, const T*, const T*,         \
                                              const T*, const T*, const T*, T*, T*, T*);
MHA_INSTANTIATE(float)
MHA_INSTANTIATE(double)
#undef MHA_INSTANTIATE

}  // namespace mha::variants
