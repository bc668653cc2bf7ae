// Plain loops of the layer kernels (semantics in cpu/layers/layers.h), in
// float64 arithmetic: the ground truth of the fused kernels.
//   GELU exact:  f = x Φ(x),  f' = Φ(x) + x φ(x),  Φ(x) = ½(1 + erf(x/√2)), φ(x) = e^{-x²/2}/√(2π)
//   GELU tanh:   f = ½x(1 + t),  t = tanh(u),  u = √(2/π)(x + 0.044715x³)
//                f' = ½(1 + t) + ½x(1 - t²)·√(2/π)(1 + 3·0.044715x²)
//   LayerNorm:   x̂ = (x - μ)·r, r = 1/sqrt(σ² + ε), g = dy·w,
//                dx = r · (g - mean(g) - x̂ · mean(g·x̂)) (the two means remove the
//                components along 1 and x̂ that normalisation cannot change)
#include "cpu/reference/layers.h"

#include <cmath>

namespace mha::cpu::reference {

namespace {
constexpr double kSqrt2OverPi = 0.7978845608028654, kInvSqrt2 = 0.7071067811865476, kInvSqrt2Pi = 0.3989422804014327;
}  // namespace

double activation(ActivationKind kind, double v) {
  switch (kind) {
    case ActivationKind::relu: return v > 0 ? v : (std::isnan(v) ? v : 0.0);
    case ActivationKind::gelu: return 0.5 * v * (1 + std::erf(v * kInvSqrt2));
    case ActivationKind::gelu_tanh: return 0.5 * v * (1 + std::tanh(kSqrt2OverPi * (v + 0.044715 * v * v * v)));
  }
  return v;
}

double activation_derivative(ActivationKind kind, double v) {
  switch (kind) {
    case ActivationKind::relu: return v > 0 ? 1.0 : 0.0;
    case ActivationKind::gelu: return 0.5 * (1 + std::erf(v * kInvSqrt2)) + v * kInvSqrt2Pi * std::exp(-0.5 * v * v);
    case ActivationKind::gelu_tanh: {
      const double t = std::tanh(kSqrt2OverPi * (v + 0.044715 * v * v * v));
      return 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * kSqrt2OverPi * (1 + 3 * 0.044715 * v * v);
    }
  }
  return 1.0;
}

template <class T>
void activation_forward(ActivationKind kind, const T* x, const T* bias, T* pre, T* y, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const T v = bias ? T(x[r * cols + c] + bias[c]) : x[r * cols + c];
      if (pre) pre[r * cols + c] = v;
      y[r * cols + c] = T(activation(kind, double(v)));
    }
}

template <class T>
void activation_backward(ActivationKind kind, const T* x, const T* dy, T* dx, T* dbias, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const T d = T(double(dy[r * cols + c]) * activation_derivative(kind, double(x[r * cols + c])));
      dx[r * cols + c] = d;
      if (dbias) dbias[c] += d;
    }
}

template <class T>
void layer_norm_forward(const LayerNormForwardOf<T>& p) {
  const int64_t D = p.D;
  for (int64_t r = 0; r < p.rows; ++r) {
    const T* row = p.x + r * D;
    if (p.residual) {
      for (int64_t d = 0; d < D; ++d) p.sum[r * D + d] = row[d] + p.residual[r * D + d];
      row = p.sum + r * D;
    }
    double mean = 0, var = 0;  // two passes in double: exact enough for any D
    for (int64_t d = 0; d < D; ++d) mean += double(row[d]);
    mean /= double(D);
    for (int64_t d = 0; d < D; ++d) var += (double(row[d]) - mean) * (double(row[d]) - mean);
    var /= double(D);
    const double rstd = 1.0 / std::sqrt(var + p.eps);
    p.mean[r] = T(mean), p.rstd[r] = T(rstd);
    for (int64_t d = 0; d < D; ++d) {
      const double h = (double(row[d]) - mean) * rstd;
      p.y[r * D + d] = T(p.weight ? h * double(p.weight[d]) + double(p.bias[d]) : h);
    }
  }
}

template <class T>
void layer_norm_backward(const LayerNormBackwardOf<T>& p) {
  const int64_t D = p.D;
  for (int64_t r = 0; r < p.rows; ++r) {
    const T *g = p.dy + r * D, *h = p.h + r * D;
    const double mean = double(p.mean[r]), rstd = double(p.rstd[r]);
    auto xhat = [&](int64_t d) { return (double(h[d]) - mean) * rstd; };
    auto gw = [&](int64_t d) { return double(g[d]) * (p.weight ? double(p.weight[d]) : 1.0); };
    double mean_g = 0, mean_gx = 0;
    for (int64_t d = 0; d < D; ++d) mean_g += gw(d), mean_gx += gw(d) * xhat(d);
    mean_g /= double(D);
    mean_gx /= double(D);
    for (int64_t d = 0; d < D; ++d) {
      const double v = rstd * (gw(d) - mean_g - xhat(d) * mean_gx);
      p.dx[r * D + d] = T(p.residual_grad ? v + double(p.residual_grad[r * D + d]) : v);
    }
    if (p.dweight)  // rows in order, so the sums do not depend on threads
      for (int64_t d = 0; d < D; ++d) {
        p.dweight[d] += T(double(g[d]) * xhat(d));
        p.dbias[d] += g[d];
      }
  }
}

template <class T>
double cross_entropy_forward_backward(const CrossEntropyOf<T>& p, int64_t* count, int64_t* correct) {
  const int64_t C = p.C;
  const double eps = p.label_smoothing;
  double total = 0;
  *count = *correct = 0;
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t t = p.targets[r];
    T* d = p.dlogits + r * C;
    if (t == p.ignore_index) {
      for (int64_t c = 0; c < C; ++c) d[c] = T(0);
      continue;
    }
    ++*count;
    const T* row = p.logits + r * C;
    double max = row[0];
    int64_t argmax = 0;
    for (int64_t c = 1; c < C; ++c)
      if (row[c] > max) max = row[c], argmax = c;
    double sum = 0, sum_logits = 0;
    for (int64_t c = 0; c < C; ++c) sum += std::exp(double(row[c]) - max), sum_logits += double(row[c]);
    const double lse = max + std::log(sum);
    // -log p_target and mean_c(-log p_c) = lse - mean_c(logit_c)
    total += (1 - eps) * (lse - double(row[t])) + eps * (lse - sum_logits / double(C));
    *correct += argmax == t;
    for (int64_t c = 0; c < C; ++c) {
      const double q = (c == t ? 1 - eps : 0.0) + eps / double(C);
      d[c] = T((std::exp(double(row[c]) - lse) - q) * p.grad_scale);
    }
  }
  return total;
}

template <class T>
void adamw_step(const AdamWStepOf<T>& p) {
  const double c = p.lr, b1 = p.beta1, b2 = p.beta2;
  for (int64_t k = 0; k < p.n; ++k) {
    T* w = p.param + k;
    T* m = p.exp_avg + k;
    T* v = p.exp_avg_sq + k;
    const double g = double(p.grad[k]);
    *w = T(double(*w) * (1 - c * p.weight_decay));
    *m = T(b1 * double(*m) + (1 - b1) * g);
    *v = T(b2 * double(*v) + (1 - b2) * g * g);
    *w = T(double(*w) - c * (double(*m) / p.bias1) / (std::sqrt(double(*v) / p.bias2) + p.eps));
  }
}

#define MHA_INSTANTIATE(T)                                                                                        \
  template void activation_forward<T>(ActivationKind, const T*, const T*, T*, T*, int64_t, int64_t);              \
  template void activation_backward<T>(ActivationKind, const T*, const T*, T*, T*, int64_t, int64_t);             \
  template void layer_norm_forward<T>(const LayerNormForwardOf<T>&);                                              \
  template void layer_norm_backward<T>(const LayerNormBackwardOf<T>&);                                            \
  template double cross_entropy_forward_backward<T>(const CrossEntropyOf<T>&, int64_t*, int64_t*);                \
  template void adamw_step<T>(const AdamWStepOf<T>&);
MHA_INSTANTIATE(float)
MHA_INSTANTIATE(double)
#undef MHA_INSTANTIATE

}  // namespace mha::cpu::reference
