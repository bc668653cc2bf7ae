// LayerNorm over the last dim. With x̂ = (x - μ)·r, r = 1/sqrt(σ² + ε) and
// g = dy·w, the input gradient is
//   dx = r · (g - mean(g) - x̂ · mean(g·x̂))
// (the two means remove the components along 1 and x̂ that normalisation
// cannot change); dw += Σ dy·x̂, db += Σ dy over the rows.
#include "mha/nn/layer_norm.h"

#include <cmath>

#include "nn/layer_util.h"

namespace mha::nn {

namespace {
constexpr const char* kCtor = "mha::nn::LayerNorm";
constexpr const char* kForward = "mha::nn::LayerNorm::forward";
constexpr const char* kBackward = "mha::nn::LayerNorm::backward";
}  // namespace

LayerNorm::LayerNorm(const LayerNormConfig& c) : config_(c) {
  if (c.normalized_shape <= 0) raise<ValueError>(kCtor, "normalized_shape", "> 0", std::to_string(c.normalized_shape));
  if (!(c.eps > 0) || !std::isfinite(c.eps)) raise<ValueError>(kCtor, "eps", "a finite number > 0", std::to_string(c.eps));
  check_layer_dtype(c.dtype, kCtor);
  if (c.elementwise_affine) {
    weight = Tensor::full({c.normalized_shape}, 1.0, c.dtype);
    bias = Tensor::zeros({c.normalized_shape}, c.dtype);
    weight_grad = Tensor::zeros({c.normalized_shape}, c.dtype);
    bias_grad = Tensor::zeros({c.normalized_shape}, c.dtype);
  }
}

std::vector<NamedParameter> LayerNorm::named_parameters() {
  if (!weight.defined()) return {};
  return {{"weight", &weight, &weight_grad}, {"bias", &bias, &bias_grad}};
}

Tensor LayerNorm::forward(const Tensor& x_in) {
  const int64_t D = config_.normalized_shape;
  check_input(x_in, kForward, "x", config_.dtype, D);
  const Tensor x = x_in.contiguous();
  const int64_t rows = x.numel() / D;
  Tensor y = Tensor::empty(x.shape(), config_.dtype);
  saved_xhat_ = Tensor::empty(x.shape(), config_.dtype);
  saved_rstd_ = Tensor::empty({rows}, config_.dtype);
  dispatch_float(config_.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data<T>();
    T *yp = y.data<T>(), *xh = saved_xhat_.data<T>(), *rs = saved_rstd_.data<T>();
    const T* w = weight.defined() ? weight.data<T>() : nullptr;
    const T* b = bias.defined() ? bias.data<T>() : nullptr;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = xp + r * D;
      double mean = 0, var = 0;  // two passes in double: exact enough for any D
      for (int64_t d = 0; d < D; ++d) mean += double(row[d]);
      mean /= double(D);
      for (int64_t d = 0; d < D; ++d) var += (double(row[d]) - mean) * (double(row[d]) - mean);
      var /= double(D);
      const T rstd = T(1.0 / std::sqrt(var + config_.eps));
      rs[r] = rstd;
      for (int64_t d = 0; d < D; ++d) {
        const T h = T((double(row[d]) - mean) * double(rstd));
        xh[r * D + d] = h;
        yp[r * D + d] = w ? h * w[d] + b[d] : h;
      }
    }
  });
  return y;
}

Tensor LayerNorm::backward(const Tensor& dy_in) {
  const int64_t D = config_.normalized_shape;
  check_backward(saved_xhat_, dy_in, saved_xhat_.defined() ? saved_xhat_.shape() : Shape{}, config_.dtype, kBackward);
  const Tensor dy = dy_in.contiguous();
  const int64_t rows = dy.numel() / D;
  Tensor dx = Tensor::empty(dy.shape(), config_.dtype);
  dispatch_float(config_.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T *g = dy.data<T>(), *xh = saved_xhat_.data<T>(), *rs = saved_rstd_.data<T>();
    const T* w = weight.defined() ? weight.data<T>() : nullptr;
    T* dxp = dx.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      double mean_g = 0, mean_gx = 0;
      for (int64_t d = 0; d < D; ++d) {
        const double gd = double(g[r * D + d]) * (w ? double(w[d]) : 1.0);
        mean_g += gd;
        mean_gx += gd * double(xh[r * D + d]);
      }
      mean_g /= double(D);
      mean_gx /= double(D);
      for (int64_t d = 0; d < D; ++d) {
        const double gd = double(g[r * D + d]) * (w ? double(w[d]) : 1.0);
        dxp[r * D + d] = T(double(rs[r]) * (gd - mean_g - double(xh[r * D + d]) * mean_gx));
      }
    }
    if (w)  // parameter gradients: rows in order, so the sums do not depend on threads
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < D; ++d) {
          weight_grad.data<T>()[d] += g[r * D + d] * xh[r * D + d];
          bias_grad.data<T>()[d] += g[r * D + d];
        }
  });
  return dx;
}

}  // namespace mha::nn
