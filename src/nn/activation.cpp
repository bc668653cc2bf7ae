// ReLU and GELU, forward and backward.
//   GELU exact:  f = x Φ(x),  f' = Φ(x) + x φ(x),  Φ(x) = ½(1 + erf(x/√2)), φ(x) = e^{-x²/2}/√(2π)
//   GELU tanh:   f = ½x(1 + t),  t = tanh(u),  u = √(2/π)(x + 0.044715x³)
//                f' = ½(1 + t) + ½x(1 - t²)·√(2/π)(1 + 3·0.044715x²)
#include "mha/nn/activation.h"

#include <cmath>

#include "nn/layer_util.h"

namespace mha::nn {

namespace {

// y[i] = f(x[i]) over a float32/float64 tensor of any shape.
template <class F>
Tensor map(const Tensor& x_in, const char* fn, F&& f) {
  check_defined(x_in, fn, "x");
  check_layer_dtype(x_in.dtype(), fn);
  const Tensor x = x_in.contiguous();
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    const int64_t n = x.numel();
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) yp[i] = T(f(double(xp[i])));
  });
  return y;
}

// dx[i] = dy[i] · f'(x[i]).
template <class F>
Tensor chain(const Tensor& saved_x, const Tensor& dy_in, const char* fn, F&& derivative) {
  check_backward(saved_x, dy_in, saved_x.defined() ? saved_x.shape() : Shape{}, saved_x.dtype(), fn);
  const Tensor dy = dy_in.contiguous();
  Tensor dx = Tensor::empty(dy.shape(), dy.dtype());
  dispatch_float(dy.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T *xp = saved_x.data<T>(), *g = dy.data<T>();
    T* d = dx.data<T>();
    const int64_t n = dy.numel();
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) d[i] = T(double(g[i]) * derivative(double(xp[i])));
  });
  return dx;
}

constexpr double kSqrt2OverPi = 0.7978845608028654, kInvSqrt2 = 0.7071067811865476, kInvSqrt2Pi = 0.3989422804014327;

}  // namespace

Tensor ReLU::forward(const Tensor& x) {
  Tensor y = map(x, "mha::nn::ReLU::forward", [](double v) { return v > 0 ? v : 0.0; });
  saved_x_ = x.contiguous();
  return y;
}

Tensor ReLU::backward(const Tensor& dy) {
  return chain(saved_x_, dy, "mha::nn::ReLU::backward", [](double v) { return v > 0 ? 1.0 : 0.0; });
}

Tensor GELU::forward(const Tensor& x) {
  const bool tanh_form = approximate_ == Approximate::tanh;
  Tensor y = map(x, "mha::nn::GELU::forward", [tanh_form](double v) {
    if (tanh_form) return 0.5 * v * (1 + std::tanh(kSqrt2OverPi * (v + 0.044715 * v * v * v)));
    return 0.5 * v * (1 + std::erf(v * kInvSqrt2));
  });
  saved_x_ = x.contiguous();
  return y;
}

Tensor GELU::backward(const Tensor& dy) {
  const bool tanh_form = approximate_ == Approximate::tanh;
  return chain(saved_x_, dy, "mha::nn::GELU::backward", [tanh_form](double v) {
    if (tanh_form) {
      const double t = std::tanh(kSqrt2OverPi * (v + 0.044715 * v * v * v));
      return 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * kSqrt2OverPi * (1 + 3 * 0.044715 * v * v);
    }
    return 0.5 * (1 + std::erf(v * kInvSqrt2)) + v * kInvSqrt2Pi * std::exp(-0.5 * v * v);
  });
}

}  // namespace mha::nn
