// The layer kernels of layers.h over row ranges, written once against
// cpu/simd/vec.h and included by one translation unit per instruction set
// (kernel_avx512.cpp, kernel_avx2.cpp, kernel_scalar.cpp). dispatch.cpp
// splits the rows over threads and adds up the per-block sums.
//
// Exact GELU, f = x·Φ(x) with Φ(x) = ½ erfc(-x/√2): erfc(z) for z ≥ 0 from
// Abramowitz & Stegun 7.1.26, t·(a1 + t(a2 + t(a3 + t(a4 + t a5))))·e^{-z²},
// t = 1/(1 + p z), absolute error ≤ 1.5e-7; for x < 0, Φ = ½ erfc(|x|/√2)
// directly (no cancellation in the tail), for x ≥ 0, 1 - ½ erfc(x/√2). The
// derivative Φ(x) + x φ(x) reuses e^{-z²} = e^{-x²/2} = √(2π) φ(x).
// Tanh GELU, f = ½x(1 + tanh u), with 1 + tanh u = 2e/(e + 1), e = e^{2u}
// (no cancellation for u ≪ 0; e capped at 2^100, where the ratio is 2).
//
// No std:: functions here (as in cpu/flash/kernel.h): a copy built for
// AVX-512 must never be the one the linker keeps for the portable path.
#pragma once

#include <cstdint>

#include "cpu/layers/kernels.h"
#include "cpu/layers/layers.h"
#include "cpu/simd/vec.h"

namespace mha::cpu::MHA_ISA_NAMESPACE {

namespace layer_kernels {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kInvSqrt2 = 0.7071067811865476f, kInvSqrt2Pi = 0.3989422804014327f;
constexpr float kSqrt2OverPi = 0.7978845608028654f, kTanhCubic = 0.044715f;

inline Vec exp_of(Vec x) { return exp2(x * Vec::set1(kLog2e)); }

// Φ(x), and e^{-x²/2} into *gauss.
inline Vec normal_cdf(Vec x, Vec* gauss) {
  const Vec z = abs(x) * Vec::set1(kInvSqrt2);
  const Vec one = Vec::set1(1.0f);
  const Vec t = one / fma(Vec::set1(0.3275911f), z, one);
  Vec poly = fma(Vec::set1(1.061405429f), t, Vec::set1(-1.453152027f));
  poly = fma(poly, t, Vec::set1(1.421413741f));
  poly = fma(poly, t, Vec::set1(-0.284496736f));
  poly = fma(poly, t, Vec::set1(0.254829592f));
  poly = poly * t;
  *gauss = exp_of(Vec::zero() - z * z);
  const Vec half_tail = Vec::set1(0.5f) * poly * *gauss;  // ½ erfc(|x|/√2)
  return select_gt(x, Vec::zero(), one - half_tail, half_tail);
}

// 1 + tanh(u) for the tanh form, with u's derivative factor into *du.
inline Vec one_plus_tanh(Vec x, Vec* du) {
  const Vec x2 = x * x;
  const Vec u = Vec::set1(kSqrt2OverPi) * fma(Vec::set1(kTanhCubic) * x2, x, x);
  if (du) *du = Vec::set1(kSqrt2OverPi) * fma(Vec::set1(3.0f * kTanhCubic), x2, Vec::set1(1.0f));
  const Vec e = exp2(min(Vec::set1(2.0f * kLog2e) * u, Vec::set1(100.0f)));
  return Vec::set1(2.0f) * e / (e + Vec::set1(1.0f));
}

template <ActivationKind kKind>
inline Vec activate(Vec x) {
  if constexpr (kKind == ActivationKind::relu) {
    return max(Vec::zero(), x);  // x86 max returns its second operand for NaN: NaN stays
  } else if constexpr (kKind == ActivationKind::gelu) {
    Vec gauss;
    return x * normal_cdf(x, &gauss);
  } else {
    return Vec::set1(0.5f) * x * one_plus_tanh(x, nullptr);
  }
}

template <ActivationKind kKind>
inline Vec derivative(Vec x) {
  if constexpr (kKind == ActivationKind::relu) {
    return select_gt(x, Vec::zero(), Vec::set1(1.0f), Vec::zero());
  } else if constexpr (kKind == ActivationKind::gelu) {
    Vec gauss;
    const Vec cdf = normal_cdf(x, &gauss);
    return fma(x * Vec::set1(kInvSqrt2Pi), gauss, cdf);
  } else {
    Vec du;
    const Vec s = one_plus_tanh(x, &du);  // 1 + t;  1 - t² = s·(2 - s)
    const Vec half = Vec::set1(0.5f);
    return fma(half * x * s * (Vec::set1(2.0f) - s), du, half * s);
  }
}

inline Vec load_n(const float* p, int lanes) { return lanes == Vec::W ? Vec::load(p) : Vec::load_partial(p, lanes); }
// bfloat16 (its bits) widened: exact.
inline Vec load_n(const uint16_t* p, int lanes) {
  return lanes == Vec::W ? Vec::load_bf16(p) : Vec::load_bf16_partial(p, lanes);
}
inline void store_n(Vec v, float* p, int lanes) {
  if (lanes == Vec::W) v.store(p);
  else v.store_partial(p, lanes);
}
// Out = uint16_t: the lanes rounded to bfloat16 (the operand of a bf16 product).
inline void store_n(Vec v, uint16_t* p, int lanes) {
  if (lanes == Vec::W) v.store_bf16(p);
  else v.store_bf16_partial(p, lanes);
}

// f(v) on every full vector of [0, n) and on its tail: f(Vec, offset, lanes).
template <class F>
inline void for_vectors(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + Vec::W <= n; i += Vec::W) f(i, Vec::W);
  if (i < n) f(i, int(n - i));
}

// One row of cols: pre = x + bias, y = f(pre); Out float or uint16_t (bfloat16).
template <ActivationKind kKind, class Out>
void activation_row(const float* x, const float* bias, float* pre, Out* y, int64_t cols) {
  for_vectors(cols, [&](int64_t c, int n) {
    Vec v = load_n(x + c, n);
    if (bias) v = v + load_n(bias + c, n);
    if (pre) store_n(v, pre + c, n);
    store_n(activate<kKind>(v), y + c, n);
  });
}

// One row: dx = dy·f'(x); dbias_acc (cols) += dx (before any rounding of dx).
template <ActivationKind kKind, class Out>
void activation_backward_row(const float* x, const float* dy, Out* dx, float* dbias_acc, int64_t cols) {
  for_vectors(cols, [&](int64_t c, int n) {
    const Vec d = load_n(dy + c, n) * derivative<kKind>(load_n(x + c, n));
    store_n(d, dx + c, n);
    if (dbias_acc) store_n(load_n(dbias_acc + c, n) + d, dbias_acc + c, n);
  });
}

// 1 in lanes [0, n), 0 above.
inline Vec lanes_below(int n) {
  static constexpr float kOnes[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  return n == Vec::W ? Vec::set1(1.0f) : Vec::load_partial(kOnes, n);
}

}  // namespace layer_kernels

template <class Out>
void activation_rows(ActivationKind kind, const float* x, const float* bias, float* pre, Out* y, int64_t begin,
                     int64_t end, int64_t cols) {
  using namespace layer_kernels;
  for (int64_t r = begin; r < end; ++r) {
    const float* xr = x + r * cols;
    float* pr = pre ? pre + r * cols : nullptr;
    Out* yr = y + r * cols;
    switch (kind) {
      case ActivationKind::relu: activation_row<ActivationKind::relu>(xr, bias, pr, yr, cols); break;
      case ActivationKind::gelu: activation_row<ActivationKind::gelu>(xr, bias, pr, yr, cols); break;
      case ActivationKind::gelu_tanh: activation_row<ActivationKind::gelu_tanh>(xr, bias, pr, yr, cols); break;
    }
  }
}

template <class Out>
void activation_backward_rows(ActivationKind kind, const float* x, const float* dy, Out* dx, float* dbias_acc,
                              int64_t begin, int64_t end, int64_t cols) {
  using namespace layer_kernels;
  for (int64_t r = begin; r < end; ++r) {
    const int64_t o = r * cols;
    switch (kind) {
      case ActivationKind::relu:
        activation_backward_row<ActivationKind::relu>(x + o, dy + o, dx + o, dbias_acc, cols);
        break;
      case ActivationKind::gelu:
        activation_backward_row<ActivationKind::gelu>(x + o, dy + o, dx + o, dbias_acc, cols);
        break;
      case ActivationKind::gelu_tanh:
        activation_backward_row<ActivationKind::gelu_tanh>(x + o, dy + o, dx + o, dbias_acc, cols);
        break;
    }
  }
}

// Rows [begin, end) of LayerNorm forward. Mean and variance in two sweeps of
// the row, which sits in L1 after the first (D ≤ 8k floats): no cancellation
// from E[x²] - E[x]², at the cost of one more read of cached data.
inline void layer_norm_rows(const LayerNormForward& p, int64_t begin, int64_t end) {
  using namespace layer_kernels;
  const int64_t D = p.D;
  for (int64_t r = begin; r < end; ++r) {
    const float* x = p.x + r * D;
    const float* h = x;
    Vec acc = Vec::zero();
    if (p.residual) {
      const float* res = p.residual + r * D;
      float* sum = p.sum + r * D;
      for_vectors(D, [&](int64_t i, int n) {
        const Vec v = load_n(x + i, n) + load_n(res + i, n);
        store_n(v, sum + i, n);
        acc = acc + v;
      });
      h = sum;
    } else {
      for_vectors(D, [&](int64_t i, int n) { acc = acc + load_n(x + i, n); });
    }
    const float mean = reduce_add(acc) / float(D);
    const Vec m = Vec::set1(mean);
    Vec sq = Vec::zero();
    for_vectors(D, [&](int64_t i, int n) {
      const Vec c = (load_n(h + i, n) - m) * lanes_below(n);  // lanes past n read 0: drop their (0 - μ)²
      sq = fma(c, c, sq);
    });
    const float var = reduce_add(sq) / float(D);
    const float rstd = 1.0f / __builtin_sqrtf(var + float(p.eps));
    p.mean[r] = mean, p.rstd[r] = rstd;
    const Vec rs = Vec::set1(rstd);
    float* y = p.y + r * D;
    for_vectors(D, [&](int64_t i, int n) {
      Vec v = (load_n(h + i, n) - m) * rs;
      if (p.weight) v = fma(v, load_n(p.weight + i, n), load_n(p.bias + i, n));
      store_n(v, y + i, n);
    });
  }
}

// Rows [begin, end) of LayerNorm backward; dweight_acc, dbias_acc (D) += this
// range's Σ dy·x̂ and Σ dy (null without affine).
inline void layer_norm_backward_rows(const LayerNormBackward& p, int64_t begin, int64_t end, float* dweight_acc,
                                     float* dbias_acc) {
  using namespace layer_kernels;
  const int64_t D = p.D;
  for (int64_t r = begin; r < end; ++r) {
    const float *h = p.h + r * D, *dy = p.dy + r * D;
    const Vec m = Vec::set1(p.mean[r]), rs = Vec::set1(p.rstd[r]);
    Vec sum_g = Vec::zero(), sum_gx = Vec::zero();
    for_vectors(D, [&](int64_t i, int n) {
      // Lanes past n: h and dy read 0, so g = 0 and they add nothing.
      const Vec xhat = (load_n(h + i, n) - m) * rs, d = load_n(dy + i, n);
      const Vec g = p.weight ? d * load_n(p.weight + i, n) : d;
      sum_g = sum_g + g;
      sum_gx = fma(g, xhat, sum_gx);
      if (dweight_acc) {
        store_n(fma(d, xhat, load_n(dweight_acc + i, n)), dweight_acc + i, n);
        store_n(load_n(dbias_acc + i, n) + d, dbias_acc + i, n);
      }
    });
    const Vec mean_g = Vec::set1(reduce_add(sum_g) / float(D)), mean_gx = Vec::set1(reduce_add(sum_gx) / float(D));
    float* dx = p.dx + r * D;
    const float* rg = p.residual_grad ? p.residual_grad + r * D : nullptr;
    for_vectors(D, [&](int64_t i, int n) {
      const Vec xhat = (load_n(h + i, n) - m) * rs, d = load_n(dy + i, n);
      const Vec g = p.weight ? d * load_n(p.weight + i, n) : d;
      Vec v = rs * (g - mean_g - xhat * mean_gx);
      if (rg) v = v + load_n(rg + i, n);
      store_n(v, dx + i, n);
    });
  }
}

// Rows [begin, end) of softmax cross-entropy; row_loss[r] gets each row's
// loss (0 when ignored), row_correct[r] 1 when its argmax is the target.
inline void cross_entropy_rows(const CrossEntropy& p, int64_t begin, int64_t end, double* row_loss,
                               uint8_t* row_correct) {
  using namespace layer_kernels;
  const int64_t C = p.C;
  const float eps = float(p.label_smoothing), scale = float(p.grad_scale);
  for (int64_t r = begin; r < end; ++r) {
    const float* x = p.logits + r * C;
    float* d = p.dlogits + r * C;
    const int64_t t = p.targets[r];
    row_loss[r] = 0, row_correct[r] = 0;
    if (t == p.ignore_index) {
      for_vectors(C, [&](int64_t i, int n) { store_n(Vec::zero(), d + i, n); });
      continue;
    }
    float top = x[0];
    int64_t argmax = 0;
    for (int64_t c = 1; c < C; ++c)
      if (x[c] > top) top = x[c], argmax = c;
    const Vec mx = Vec::set1(top);
    Vec sum = Vec::zero(), sum_x = Vec::zero();
    for_vectors(C, [&](int64_t i, int n) {
      const Vec v = load_n(x + i, n);
      sum = fma(exp_of(v - mx), lanes_below(n), sum);
      sum_x = sum_x + v;
    });
    const float lse = top + __builtin_logf(reduce_add(sum));
    const double mean_x = double(reduce_add(sum_x)) / double(C);
    // ε·(lse - mean) always, so that a NaN logit anywhere makes the loss NaN.
    row_loss[r] = (1 - p.label_smoothing) * (double(lse) - double(x[t])) + p.label_smoothing * (double(lse) - mean_x);
    row_correct[r] = argmax == t;
    const Vec l = Vec::set1(lse), off = Vec::set1(eps / float(C)), s = Vec::set1(scale);
    for_vectors(C, [&](int64_t i, int n) { store_n((exp_of(load_n(x + i, n) - l) - off) * s, d + i, n); });
    d[t] -= (1 - eps) * scale;
  }
}

inline void adamw_range(const AdamWStep& p, int64_t begin, int64_t end) {
  using namespace layer_kernels;
  const Vec decay = Vec::set1(float(1 - p.lr * p.weight_decay)), b1 = Vec::set1(float(p.beta1)),
            c1 = Vec::set1(float(1 - p.beta1)), b2 = Vec::set1(float(p.beta2)), c2 = Vec::set1(float(1 - p.beta2));
  const Vec step = Vec::set1(float(p.lr / p.bias1)), inv_bias2 = Vec::set1(float(1 / p.bias2)),
            eps = Vec::set1(float(p.eps));
  for_vectors(end - begin, [&](int64_t i, int n) {
    const int64_t k = begin + i;
    const Vec g = load_n(p.grad + k, n);
    const Vec m = fma(b1, load_n(p.exp_avg + k, n), c1 * g);
    const Vec v = fma(b2, load_n(p.exp_avg_sq + k, n), c2 * g * g);
    store_n(m, p.exp_avg + k, n);
    store_n(v, p.exp_avg_sq + k, n);
    const Vec w = load_n(p.param + k, n) * decay;
    store_n(w - step * m / (sqrt(v * inv_bias2) + eps), p.param + k, n);
  });
}

inline float sum_of_squares_range(const float* x, int64_t n) {
  using namespace layer_kernels;
  Vec a = Vec::zero(), b = Vec::zero();
  int64_t i = 0;
  for (; i + 2 * Vec::W <= n; i += 2 * Vec::W) {
    const Vec u = Vec::load(x + i), v = Vec::load(x + i + Vec::W);
    a = fma(u, u, a), b = fma(v, v, b);
  }
  for_vectors(n - i, [&](int64_t j, int lanes) {
    const Vec u = load_n(x + i + j, lanes);
    a = fma(u, u, a);
  });
  return reduce_add(a + b);
}

// Whether rows × cols floats, rows `pitch` apart, hold no NaN and no
// infinity: x - x is 0 for every finite x and NaN for ±inf and NaN, and a NaN
// stays in a sum (zeros add to exactly 0). Four sums, so that the adds do not
// wait on one another; a lane of a row's tail past cols loads as 0.
inline bool finite_rows(const float* x, int64_t rows, int64_t cols, int64_t pitch) {
  using namespace layer_kernels;
  Vec a = Vec::zero(), b = Vec::zero(), c = Vec::zero(), d = Vec::zero();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * pitch;
    int64_t i = 0;
    for (; i + 4 * Vec::W <= cols; i += 4 * Vec::W) {
      const Vec u = Vec::load(row + i), v = Vec::load(row + i + Vec::W), w = Vec::load(row + i + 2 * Vec::W),
                z = Vec::load(row + i + 3 * Vec::W);
      a = a + (u - u), b = b + (v - v), c = c + (w - w), d = d + (z - z);
    }
    for_vectors(cols - i, [&](int64_t j, int lanes) {
      const Vec u = load_n(row + i + j, lanes);
      a = a + (u - u);
    });
  }
  return reduce_add((a + b) + (c + d)) == 0.0f;
}

inline void scale_range(float* x, int64_t n, float s) {
  using namespace layer_kernels;
  const Vec f = Vec::set1(s);
  for_vectors(n, [&](int64_t i, int lanes) { store_n(load_n(x + i, lanes) * f, x + i, lanes); });
}

// dst = src rounded to bfloat16 (its bits), as Vec::store_bf16 rounds.
inline void round_range(const float* src, uint16_t* dst, int64_t n) {
  using namespace layer_kernels;
  for_vectors(n, [&](int64_t i, int lanes) { store_n(load_n(src + i, lanes), dst + i, lanes); });
}

// B float, or uint16_t: bfloat16 bits, widened exactly.
template <class B>
void add_range(const float* a, const B* b, float* out, int64_t n) {
  using namespace layer_kernels;
  for_vectors(n, [&](int64_t i, int lanes) { store_n(load_n(a + i, lanes) + load_n(b + i, lanes), out + i, lanes); });
}

// This instruction set's entries, in the order of kernels.h's table (one
// list for every kernel_<isa>.cpp).
inline LayerKernels kernel_table() {
  return {&activation_rows<float>, &activation_backward_rows<float>, &activation_rows<uint16_t>,
          &activation_backward_rows<uint16_t>, &layer_norm_rows, &layer_norm_backward_rows, &cross_entropy_rows,
          &adamw_range, &sum_of_squares_range, &scale_range, &add_range<float>, &add_range<uint16_t>,
          &finite_rows, &round_range};
}

}  // namespace mha::cpu::MHA_ISA_NAMESPACE
