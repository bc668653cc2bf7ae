// Reference attention: plain loops, one query row at a time, exact softmax.
// The ground truth every fast path is tested against. O(S) scratch per row.
//
// Forward, for each batch entry b and query row i (keys j in the band, key_begin(i) <= j < key_end(i)):
//   s_j   = scale · q_i·k_j + mask_ij
//   lse_i = log Σ_j exp(s_j)                  (-inf when every s_j = -inf)
//   P_ij  = exp(s_j - lse_i) · c_ij,  c_ij = keep_ij / (1 - p)  (1 without dropout)
//   o_i   = Σ_j P_ij v_j
// Backward, with D_i = Σ_e do_ie o_ie = Σ_j P_ij (do_i·v_j):
//   dv_j += P_ij do_i
//   dS_ij = exp(s_j - lse_i) · (c_ij · do_i·v_j - D_i)     (gradient of s_j)
//   dq_i += scale · dS_ij k_j,  dk_j += scale · dS_ij q_i,  dmask_ij = dS_ij
// A fully masked row (lse = -inf) contributes nothing.
//
// Non-finite inputs: keys excluded by the mask (false, or -inf added), the
// band or causality are skipped, never read, so a NaN or infinity there
// changes nothing; every other entry is computed in IEEE arithmetic, so a NaN
// or infinity reaches exactly the outputs and gradients whose formula reads it
// (a weight that underflows to 0 or is dropped still multiplies: 0·NaN = NaN,
// as in PyTorch). A row whose allowed logits are all -inf from the data (not
// the mask) is NaN, as exp(-inf - (-inf)) is; only the mask empties a row.
#include "cpu/reference/attention.h"

#include <cmath>
#include <vector>

#include "attention_params.h"
#include "cpu/parallel.h"
#include "cpu/reduce.h"
#include "dtype_dispatch.h"
#include "random/philox.h"

namespace mha::cpu {

namespace {

Shape leading(const Shape& s, size_t trailing) { return Shape(s.begin(), s.end() - long(trailing)); }

// Rows of a (batch…, rows, cols) operand: element (b, i, e) at
// base[offset[b] + i·row + e·col].
template <class T>
struct Rows {
  T* base;
  std::vector<int64_t> offset;
  int64_t row, col;

  T* at(int64_t b, int64_t i) const { return base + offset[size_t(b)] + i * row; }
};

template <class T, class Tensor_>
Rows<T> rows_of(Tensor_& t, const Shape& batch_shape) {
  return {t.template data<std::remove_const_t<T>>(),
          batch_offsets(batch_shape, leading(t.shape(), 2), leading(t.strides(), 2)), t.stride(-2),
          t.stride(-1)};
}

template <class A, class T>
A dot(const T* x, int64_t xs, const T* y, int64_t ys, int64_t n) {
  A acc = 0;
  for (int64_t e = 0; e < n; ++e) acc += load_as<A>(x[e * xs]) * load_as<A>(y[e * ys]);
  return acc;
}

template <class A>
struct Dropout {
  bool on;
  uint64_t seed;
  uint32_t threshold;
  A scale;

  explicit Dropout(const AttentionParams& p)
      : on(p.dropout_p > 0), seed(p.dropout_seed), threshold(dropout_threshold(p.dropout_p)),
        scale(A(1.0 / (1.0 - p.dropout_p))) {}
  A factor(int64_t b, int64_t i, int64_t j) const {
    if (!on) return A(1);
    return dropout_keep(seed, uint64_t(b), uint64_t(i), uint64_t(j), threshold) ? scale : A(0);
  }
};

// Logits of row (b, i) for keys begin <= j < end into s[j], and keep[j]:
// whether the mask allows key j (an excluded key's logit is not computed).
// Returns the number of allowed keys and, in max, their largest logit (NaN
// when any is NaN).
template <class T, class A>
int64_t row_logits(const AttentionParams& p, const Rows<const T>& q, const Rows<const T>& k, const A* mask,
                   int64_t b, int64_t i, int64_t begin, int64_t end, A* s, uint8_t* keep, A& max) {
  const A scale = A(p.scale);
  const T* qi = q.at(b, i);
  const A* mrow = mask ? mask + p.mask_offset[size_t(b)] + i * p.mask_row : nullptr;
  max = -INFINITY;
  int64_t allowed = 0;
  bool nan = false;
  for (int64_t j = begin; j < end; ++j) {
    const A m = mrow ? mrow[j * p.mask_col] : A(0);
    keep[j] = m != -INFINITY;
    if (!keep[j]) {
      s[j] = -INFINITY;
      continue;
    }
    const A x = scale * dot<A>(qi, q.col, k.at(b, j), k.col, p.E) + m;
    s[j] = x;
    ++allowed;
    if (std::isnan(x)) nan = true;
    else if (x > max) max = x;
  }
  if (nan) max = A(NAN);
  return allowed;
}

template <class T, class A>
void forward(const AttentionParams& p, AttentionOutput& r) {
  const Rows<const T> q = rows_of<const T>(p.q, p.batch_shape), k = rows_of<const T>(p.k, p.batch_shape),
                      v = rows_of<const T>(p.v, p.batch_shape);
  const A* mask = p.mask.defined() ? p.mask.data<A>() : nullptr;
  T* out = r.out.data<T>();
  A* lse = r.lse.data<A>();
  T* weights = r.weights.defined() ? r.weights.data<T>() : nullptr;
  const Dropout<A> dropout(p);
  const int64_t L = p.L, S = p.S, Ev = p.Ev;
  RegionErrors errors;  // the buffers of each thread may be refused (parallel.h)
#pragma omp parallel
  {
    std::vector<A> s, acc;
    std::vector<uint8_t> keep;
    errors.run([&] { s.resize(size_t(S)), acc.resize(size_t(Ev)), keep.resize(size_t(S)); });
#pragma omp for schedule(static)
    for (int64_t row = 0; row < p.batch * L; ++row) {
      if (errors.failed()) continue;
      const int64_t b = row / L, i = row % L, begin = p.key_begin(i), end = p.key_end(i);
      T* o = out + row * Ev;
      T* w = weights ? weights + row * S : nullptr;
      A max = -INFINITY;
      const int64_t allowed =
          end > begin ? row_logits<T, A>(p, q, k, mask, b, i, begin, end, s.data(), keep.data(), max) : 0;
      if (allowed == 0) {  // fully masked row
        lse[row] = -INFINITY;
        for (int64_t e = 0; e < Ev; ++e) o[e] = store_as<T>(A(0));
        if (w)
          for (int64_t j = 0; j < S; ++j) w[j] = store_as<T>(A(0));
        continue;
      }
      A sum = 0;
      for (int64_t j = begin; j < end; ++j)
        if (keep[size_t(j)]) sum += (s[size_t(j)] = std::exp(s[size_t(j)] - max));
      lse[row] = max + std::log(sum);
      std::fill(acc.begin(), acc.end(), A(0));
      if (w)
        for (int64_t j = 0; j < S; ++j) w[j] = store_as<T>(A(0));
      for (int64_t j = begin; j < end; ++j) {
        if (!keep[size_t(j)]) continue;
        const A pij = s[size_t(j)] / sum * dropout.factor(b, i, j);
        if (w) w[j] = store_as<T>(pij);
        const T* vj = v.at(b, j);
        for (int64_t e = 0; e < Ev; ++e) acc[size_t(e)] += pij * load_as<A>(vj[e * v.col]);
      }
      for (int64_t e = 0; e < Ev; ++e) o[e] = store_as<T>(acc[size_t(e)]);
    }
  }
  errors.rethrow();
}

template <class T, class A>
void backward(const AttentionParams& p, const Tensor& dout_t, const AttentionOutput& fwd, AttentionGradients& g) {
  const Rows<const T> q = rows_of<const T>(p.q, p.batch_shape), k = rows_of<const T>(p.k, p.batch_shape),
                      v = rows_of<const T>(p.v, p.batch_shape), out = rows_of<const T>(fwd.out, p.batch_shape),
                      dout = rows_of<const T>(dout_t, p.batch_shape);
  const Tensor lse_t = fwd.lse.contiguous();
  const A* lse = lse_t.data<A>();
  const A* mask = p.mask.defined() ? p.mask.data<A>() : nullptr;
  const Dropout<A> dropout(p);
  const int64_t B = p.batch, L = p.L, S = p.S, E = p.E, Ev = p.Ev;
  const A scale = A(p.scale);
  const T* dweights = p.dweights.defined() ? p.dweights.data<T>() : nullptr;
  std::vector<A> dq(size_t(B * L * E), A(0)), dk(size_t(B * S * E), A(0)), dv(size_t(B * S * Ev), A(0));
  std::vector<A> ds(g.dmask.defined() ? size_t(B * L * S) : 0, A(0));
  RegionErrors errors;
#pragma omp parallel
  {
    std::vector<A> s;
    std::vector<uint8_t> keep;
    errors.run([&] { s.resize(size_t(S)), keep.resize(size_t(S)); });
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      if (errors.failed()) continue;
      for (int64_t i = 0; i < L; ++i) {
        const A lse_i = lse[b * L + i];
        const int64_t begin = p.key_begin(i), end = p.key_end(i);
        if (lse_i == -INFINITY || end <= begin) continue;  // a fully masked row
        A max;
        row_logits<T, A>(p, q, k, mask, b, i, begin, end, s.data(), keep.data(), max);
        const T* doi = dout.at(b, i);
        // D_i = Σ_j P_ij dP_ij: dout_i·out_i, plus Σ_j W_ij dW_ij when the weights have a gradient.
        const T* dwi = dweights ? dweights + (b * L + i) * S : nullptr;
        A D = dot<A>(doi, dout.col, out.at(b, i), out.col, Ev);
        if (dwi)
          for (int64_t j = begin; j < end; ++j)
            if (keep[size_t(j)])
              D += std::exp(s[size_t(j)] - lse_i) * dropout.factor(b, i, j) * load_as<A>(dwi[j]);
        const T* qi = q.at(b, i);
        A* dqi = &dq[size_t((b * L + i) * E)];
        for (int64_t j = begin; j < end; ++j) {
          if (!keep[size_t(j)]) continue;
          const A prob = std::exp(s[size_t(j)] - lse_i), c = dropout.factor(b, i, j);
          const T* vj = v.at(b, j);
          const T* kj = k.at(b, j);
          const A dp = dot<A>(doi, dout.col, vj, v.col, Ev) + (dwi ? load_as<A>(dwi[j]) : A(0));
          const A dsij = prob * (c * dp - D);
          A* dvj = &dv[size_t((b * S + j) * Ev)];
          A* dkj = &dk[size_t((b * S + j) * E)];
          for (int64_t e = 0; e < Ev; ++e) dvj[e] += prob * c * load_as<A>(doi[e * dout.col]);
          for (int64_t e = 0; e < E; ++e) {
            dqi[e] += scale * dsij * load_as<A>(kj[e * k.col]);
            dkj[e] += scale * dsij * load_as<A>(qi[e * q.col]);
          }
          if (!ds.empty()) ds[size_t((b * L + i) * S + j)] = dsij;
        }
      }
    }
  }
  errors.rethrow();
  store_reduced(dq, p, g.dquery);
  store_reduced(dk, p, g.dkey);
  store_reduced(dv, p, g.dvalue);
  if (g.dmask.defined()) {
    std::vector<A> acc(size_t(g.dmask.numel()), A(0));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < L; ++i)
        for (int64_t j = 0; j < S; ++j)
          acc[size_t(p.mask_offset[size_t(b)] + i * p.mask_row + j * p.mask_col)] += ds[size_t((b * L + i) * S + j)];
    dispatch_dtype(g.dmask.dtype(), [&](auto tag) {
      using M = decltype(tag);
      if constexpr (!std::is_same_v<M, bool> && !std::is_same_v<M, int64_t>) {
        M* dst = g.dmask.data<M>();
        for (size_t x = 0; x < acc.size(); ++x) dst[x] = store_as<M>(acc[x]);
      }
    });
  }
}

}  // namespace

void reference_attention_forward(const AttentionParams& p, AttentionOutput& r) {
  switch (p.dtype) {
    case DType::float32: return forward<float, float>(p, r);
    case DType::float64: return forward<double, double>(p, r);
    case DType::bfloat16: return forward<bfloat16, float>(p, r);
    case DType::boolean:
    case DType::int64: break;
  }
}

void reference_attention_backward(const AttentionParams& p, const Tensor& dout, const AttentionOutput& fwd,
                                  AttentionGradients& g) {
  switch (p.dtype) {
    case DType::float32: return backward<float, float>(p, dout, fwd, g);
    case DType::float64: return backward<double, double>(p, dout, fwd, g);
    case DType::bfloat16: return backward<bfloat16, float>(p, dout, fwd, g);
    case DType::boolean:
    case DType::int64: break;
  }
}

}  // namespace mha::cpu
