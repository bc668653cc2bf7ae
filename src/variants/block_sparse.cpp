// Block-sparse attention kernels: online softmax over each query block's key
// blocks (forward), and a two-pass backward (dQ by rows of the layout, dK/dV
// by its columns). The derivation is in include/mha/variants/block_sparse.h.
// Block products go through BLAS (single-threaded inside the OpenMP loops).
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/parallel.h"
#include "finite.h"
#include "mha/attention.h"
#include "mha/variants/block_sparse.h"
#include "variants/block_sparse_layout.h"
#include "variants/common.h"

namespace mha {

namespace {

using variants::dispatch_real;

// A checked call: contiguous operands and sizes.
struct Problem {
  Tensor q, k, v;  // contiguous
  int64_t batch = 1, L = 0, S = 0, E = 0, Ev = 0;
  double scale = 1.0;
  bool causal = false;
  const BlockSparseLayout* layout = nullptr;
};

// The same attention as a dense boolean mask, on the reference path.
AttentionOptions as_dense(const BlockSparseOptions& o, const Problem& p) {
  return {.mask = block_sparse_mask(o.layout, p.L, p.S, o.causal), .scale = p.scale, .path = AttentionPath::reference};
}

Problem make_problem(const Tensor& q, const Tensor& k, const Tensor& v, const BlockSparseOptions& o,
                     const std::string& fn) {
  const variants::QkvSizes n = variants::check_qkv(q, k, v, fn);
  Problem p;
  p.batch = n.batch, p.L = n.L, p.S = n.S, p.E = n.E, p.Ev = n.Ev;
  variants::check_layout(o.layout, p.L, p.S, fn, "options.layout");
  p.scale = variants::resolve_scale(o.scale, p.E, fn);
  p.causal = o.causal;
  p.layout = &o.layout;
  p.q = q.contiguous(), p.k = k.contiguous(), p.v = v.contiguous();
  return p;
}

// Logits of query block I against key block J into s (rows × cols, leading
// dim `block`), the causal rule applied; false when the pair is entirely
// above the diagonal (nothing visible).
template <class T>
bool block_logits(const Problem& p, const T* q, const T* k, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                  T* s) {
  const int64_t ld = p.layout->block;
  if (p.causal && j0 > i0 + rows - 1) return false;
  cpu::gemm<T>(false, true, rows, cols, p.E, T(p.scale), q + i0 * p.E, p.E, k + j0 * p.E, p.E, T(0), s, ld);
  if (p.causal && j0 + cols - 1 > i0)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = std::max<int64_t>(0, i0 + r + 1 - j0); c < cols; ++c) s[r * ld + c] = -INFINITY;
  return true;
}

// Whether the layout (and causality) shows query i of query block I any key.
bool sees_a_key(const Problem& p, int64_t I, int64_t i) {
  const BlockSparseLayout& lay = *p.layout;
  for (int64_t x = lay.row_begin[size_t(I)]; x < lay.row_begin[size_t(I) + 1]; ++x) {
    const int64_t j0 = lay.key_block[size_t(x)] * lay.block;
    if (j0 < p.S && (!p.causal || j0 <= i)) return true;
  }
  return false;
}

// P = exp(s - lse) in place (0 where s or lse is -inf).
template <class T>
void probabilities(T* s, int64_t ld, int64_t rows, int64_t cols, const T* lse) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      T& x = s[r * ld + c];
      x = lse[r] == -INFINITY || x == -INFINITY ? T(0) : std::exp(x - lse[r]);
    }
}

template <class T>
void forward(const Problem& p, T* out, T* lse) {
  const BlockSparseLayout& lay = *p.layout;
  const int64_t blk = lay.block, L = p.L, S = p.S, E = p.E, Ev = p.Ev, nq = lay.query_blocks;
  const T* Q = p.q.data<T>();
  const T* K = p.k.data<T>();
  const T* V = p.v.data<T>();
  cpu::RegionErrors errors;  // buffers and products may be refused (cpu/parallel.h)
#pragma omp parallel
  {
    std::vector<T> s, m, l, acc;
    errors.run([&] { s.resize(size_t(blk * blk)), m.resize(size_t(blk)), l.resize(size_t(blk)), acc.resize(size_t(blk * Ev)); });
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < p.batch * nq; ++item) errors.run([&] {
      const int64_t b = item / nq, I = item % nq, i0 = I * blk, rows = std::min(blk, L - i0);
      const T* q = Q + b * L * E;
      const T* k = K + b * S * E;
      const T* v = V + b * S * Ev;
      std::fill(m.begin(), m.end(), T(-INFINITY));
      std::fill(l.begin(), l.end(), T(0));
      std::fill(acc.begin(), acc.end(), T(0));
      for (int64_t x = lay.row_begin[size_t(I)]; x < lay.row_begin[size_t(I) + 1]; ++x) {
        const int64_t j0 = lay.key_block[size_t(x)] * blk, cols = std::min(blk, S - j0);
        if (!block_logits(p, q, k, i0, rows, j0, cols, s.data())) continue;
        for (int64_t r = 0; r < rows; ++r) {  // online softmax: rescale the row's state to the new max
          T* sr = &s[size_t(r * blk)];
          T max = m[size_t(r)];
          for (int64_t c = 0; c < cols; ++c) max = sr[c] > max || sr[c] != sr[c] ? sr[c] : max;  // NaN stays
          if (max == -INFINITY) {  // nothing visible in this row yet
            std::fill(sr, sr + cols, T(0));
            continue;
          }
          const T alpha = std::exp(m[size_t(r)] - max);  // 0 when m was -inf
          T sum = 0;
          for (int64_t c = 0; c < cols; ++c) sum += (sr[c] = std::exp(sr[c] - max));
          l[size_t(r)] = alpha * l[size_t(r)] + sum;
          m[size_t(r)] = max;
          if (alpha != T(1))
            for (int64_t e = 0; e < Ev; ++e) acc[size_t(r * Ev + e)] *= alpha;
        }
        cpu::gemm<T>(false, false, rows, Ev, cols, T(1), s.data(), blk, v + j0 * Ev, Ev, T(1), acc.data(), Ev);
      }
      // l = 0: the row saw no key, or (when the layout shows it one) every
      // logit it saw was -inf from the data, NaN in exact arithmetic.
      for (int64_t r = 0; r < rows; ++r) {
        T* o = out + (b * L + i0 + r) * Ev;
        const T lr = l[size_t(r)];
        for (int64_t e = 0; e < Ev; ++e) o[e] = lr == 0 ? T(0) : acc[size_t(r * Ev + e)] / lr;
        lse[b * L + i0 + r] = lr != 0                ? m[size_t(r)] + std::log(lr)
                              : sees_a_key(p, I, i0 + r) ? T(NAN)
                                                        : T(-INFINITY);
      }
    });
  }
  errors.rethrow();
}

// The layout's columns: for key block J, the query blocks that see it, ascending.
void transpose_layout(const BlockSparseLayout& lay, std::vector<int64_t>& col_begin, std::vector<int64_t>& query_block) {
  col_begin.assign(size_t(lay.key_blocks) + 1, 0);
  for (int64_t J : lay.key_block) ++col_begin[size_t(J) + 1];
  for (size_t J = 0; J < size_t(lay.key_blocks); ++J) col_begin[J + 1] += col_begin[J];
  query_block.resize(lay.key_block.size());
  std::vector<int64_t> fill(col_begin.begin(), col_begin.end() - 1);
  for (int64_t I = 0; I < lay.query_blocks; ++I)
    for (int64_t x = lay.row_begin[size_t(I)]; x < lay.row_begin[size_t(I) + 1]; ++x)
      query_block[size_t(fill[size_t(lay.key_block[size_t(x)])]++)] = I;
}

template <class T>
void backward(const Problem& p, const T* dout, const T* out, const T* lse, T* dq, T* dk, T* dv) {
  const BlockSparseLayout& lay = *p.layout;
  const int64_t blk = lay.block, L = p.L, S = p.S, E = p.E, Ev = p.Ev, nq = lay.query_blocks, nk = lay.key_blocks;
  const T* Q = p.q.data<T>();
  const T* K = p.k.data<T>();
  const T* V = p.v.data<T>();
  const T scale = T(p.scale);
  variants::Buffer<T> D(p.batch * L);  // D_i = dout_i·out_i
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < p.batch * L; ++i) {
    T d = 0;
    for (int64_t e = 0; e < Ev; ++e) d += dout[i * Ev + e] * out[i * Ev + e];
    D[i] = d;
  }
  std::vector<int64_t> col_begin, query_block;
  transpose_layout(lay, col_begin, query_block);
  cpu::RegionErrors errors;
#pragma omp parallel
  {
    std::vector<T> s, dp;
    errors.run([&] { s.resize(size_t(blk * blk)), dp.resize(size_t(blk * blk)); });
    // dS = P ∘ (dout·vᵀ - D) for one block pair; s holds P on return.
    auto block_ds = [&](int64_t b, int64_t i0, int64_t rows, int64_t j0, int64_t cols) {
      if (!block_logits(p, Q + b * L * E, K + b * S * E, i0, rows, j0, cols, s.data())) return false;
      probabilities(s.data(), blk, rows, cols, lse + b * L + i0);
      cpu::gemm<T>(false, true, rows, cols, Ev, T(1), dout + (b * L + i0) * Ev, Ev, V + (b * S + j0) * Ev, Ev, T(0),
                   dp.data(), blk);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) dp[size_t(r * blk + c)] = s[size_t(r * blk + c)] * (dp[size_t(r * blk + c)] - D[b * L + i0 + r]);
      return true;
    };
    // Pass 1: dq_i = scale Σ_j dS_ij k_j, by query blocks.
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < p.batch * nq; ++item) errors.run([&] {
      const int64_t b = item / nq, I = item % nq, i0 = I * blk, rows = std::min(blk, L - i0);
      for (int64_t x = lay.row_begin[size_t(I)]; x < lay.row_begin[size_t(I) + 1]; ++x) {
        const int64_t j0 = lay.key_block[size_t(x)] * blk, cols = std::min(blk, S - j0);
        if (!block_ds(b, i0, rows, j0, cols)) continue;
        cpu::gemm<T>(false, false, rows, E, cols, scale, dp.data(), blk, K + (b * S + j0) * E, E, T(1),
                     dq + (b * L + i0) * E, E);
      }
    });
    // Pass 2: dk_j = scale Σ_i dS_ij q_i and dv_j = Σ_i P_ij dout_i, by key blocks.
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < p.batch * nk; ++item) errors.run([&] {
      const int64_t b = item / nk, J = item % nk, j0 = J * blk, cols = std::min(blk, S - j0);
      for (int64_t x = col_begin[size_t(J)]; x < col_begin[size_t(J) + 1]; ++x) {
        const int64_t i0 = query_block[size_t(x)] * blk, rows = std::min(blk, L - i0);
        if (!block_ds(b, i0, rows, j0, cols)) continue;
        cpu::gemm<T>(true, false, cols, Ev, rows, T(1), s.data(), blk, dout + (b * L + i0) * Ev, Ev, T(1),
                     dv + (b * S + j0) * Ev, Ev);
        cpu::gemm<T>(true, false, cols, E, rows, scale, dp.data(), blk, Q + (b * L + i0) * E, E, T(1),
                     dk + (b * S + j0) * E, E);
      }
    });
  }
  errors.rethrow();
}

}  // namespace

BlockSparseOutput block_sparse_attention_forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                                 const BlockSparseOptions& options) {
  const std::string fn = "mha::block_sparse_attention_forward";
  const Problem p = make_problem(query, key, value, options, fn);
  const Shape lead = variants::leading(query.shape(), 2);
  BlockSparseOutput r{Tensor::empty(variants::with_tail(lead, {p.L, p.Ev}), query.dtype()),
                      Tensor::empty(variants::with_tail(lead, {p.L}), query.dtype())};
  dispatch_real(query.dtype(), [&](auto tag) {
    using T = decltype(tag);
    forward<T>(p, r.out.data<T>(), r.lse.data<T>());
  });
  // A NaN or infinity in the inputs: the blocks multiply masked entries as 0
  // (0·NaN = NaN) and cannot say which rows depend on it. The same attention
  // as a dense mask on the reference path can (see cpu/backend.cpp).
  if (!all_finite(r.out) || !all_finite(r.lse, /*minus_inf_ok=*/true)) {
    AttentionOutput exact = attention_forward(query, key, value, as_dense(options, p));
    r.out = exact.out, r.lse = exact.lse;
  }
  return r;
}

AttentionGradients block_sparse_attention_backward(const Tensor& dout, const Tensor& query, const Tensor& key,
                                                   const Tensor& value, const BlockSparseOutput& forward_result,
                                                   const BlockSparseOptions& options) {
  const std::string fn = "mha::block_sparse_attention_backward";
  const Problem p = make_problem(query, key, value, options, fn);
  const Shape lead = variants::leading(query.shape(), 2), out_shape = variants::with_tail(lead, {p.L, p.Ev});
  variants::check_saved(dout, out_shape, {{&forward_result.out, "forward.out"}}, variants::with_tail(lead, {p.L}),
                        {{&forward_result.lse, "forward.lse"}}, query.dtype(), fn);
  AttentionGradients g{Tensor::zeros(query.shape(), query.dtype()), Tensor::zeros(key.shape(), query.dtype()),
                       Tensor::zeros(value.shape(), query.dtype()), Tensor()};
  dispatch_real(query.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const Tensor d = dout.contiguous(), o = forward_result.out.contiguous(), lse = forward_result.lse.contiguous();
    backward<T>(p, d.data<T>(), o.data<T>(), lse.data<T>(), g.dquery.data<T>(), g.dkey.data<T>(), g.dvalue.data<T>());
  });
  if (!all_finite(g.dquery) || !all_finite(g.dkey) || !all_finite(g.dvalue)) {
    AttentionOutput saved;
    saved.out = forward_result.out, saved.lse = forward_result.lse;
    g = attention_backward(dout, query, key, value, saved, as_dense(options, p));
  }
  return g;
}

}  // namespace mha
