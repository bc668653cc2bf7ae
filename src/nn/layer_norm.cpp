// LayerNorm over the last dim on the layer kernels (float32) or their
// reference loops (float64); the backward's derivation is in
// cpu/reference/layers.cpp. dw += Σ dy·x̂, db += Σ dy over the rows.
#include "mha/nn/layer_norm.h"

#include <cmath>

#include "cpu/layers/layers.h"
#include "cpu/reference/layers.h"
#include "nn/layer_util.h"

namespace mha::nn {

namespace {
constexpr const char* kCtor = "mha::nn::LayerNorm";
constexpr const char* kForward = "mha::nn::LayerNorm::forward";
constexpr const char* kForwardSum = "mha::nn::LayerNorm::forward_sum";
constexpr const char* kBackward = "mha::nn::LayerNorm::backward";
constexpr const char* kBackwardAdd = "mha::nn::LayerNorm::backward_add";

// `other` shaped and typed like `like` (the tensor it is added to).
void check_like(const Tensor& other, const Tensor& like, const char* fn, const char* name) {
  check_defined(other, fn, name);
  if (other.shape() != like.shape()) raise<ShapeError>(fn, name, "shape " + shape_string(like.shape()), shape_string(other.shape()));
  if (other.dtype() != like.dtype()) raise<DtypeError>(fn, name, to_string(like.dtype()), to_string(other.dtype()));
}

template <class T>
const T* data_or_null(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}
template <class T>
T* data_or_null(Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

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

Tensor LayerNorm::run_forward(const Tensor& x_in, const Tensor* residual_in, Tensor* sum, const char* fn) {
  const int64_t D = config_.normalized_shape;
  check_input(x_in, fn, "x", config_.dtype, D);
  const Tensor x = x_in.contiguous();
  Tensor residual;
  if (residual_in) {
    check_like(*residual_in, x_in, fn, "residual");
    residual = residual_in->contiguous();
    *sum = Tensor::empty(x.shape(), config_.dtype);
  }
  const int64_t rows = x.numel() / D;
  Tensor y = Tensor::empty(x.shape(), config_.dtype);
  saved_mean_ = Tensor::empty({rows}, config_.dtype);
  saved_rstd_ = Tensor::empty({rows}, config_.dtype);
  dispatch_float(config_.dtype, [&](auto tag) {
    using T = decltype(tag);
    const cpu::LayerNormForwardOf<T> p{.x = x.data<T>(), .residual = data_or_null<T>(residual),
                                       .sum = sum ? sum->data<T>() : nullptr, .weight = data_or_null<T>(weight),
                                       .bias = data_or_null<T>(bias), .y = y.data<T>(), .mean = saved_mean_.data<T>(),
                                       .rstd = saved_rstd_.data<T>(), .rows = rows, .D = D, .eps = config_.eps};
    if constexpr (std::is_same_v<T, float>) cpu::layer_norm_forward(p);
    else cpu::reference::layer_norm_forward(p);
  });
  saved_input_ = sum ? *sum : x;
  return y;
}

Tensor LayerNorm::forward(const Tensor& x) { return run_forward(x, nullptr, nullptr, kForward); }

Tensor LayerNorm::forward_sum(const Tensor& x, const Tensor& residual, Tensor* sum) {
  return run_forward(x, &residual, sum, kForwardSum);
}

Tensor LayerNorm::run_backward(const Tensor& dy_in, const Tensor* residual_grad_in, const char* fn) {
  const int64_t D = config_.normalized_shape;
  check_backward(saved_input_, dy_in, saved_input_.defined() ? saved_input_.shape() : Shape{}, config_.dtype, fn);
  const Tensor dy = dy_in.contiguous();
  Tensor residual_grad;
  if (residual_grad_in) {
    check_like(*residual_grad_in, dy_in, fn, "residual_grad");
    residual_grad = residual_grad_in->contiguous();
  }
  const int64_t rows = dy.numel() / D;
  Tensor dx = Tensor::empty(dy.shape(), config_.dtype);
  dispatch_float(config_.dtype, [&](auto tag) {
    using T = decltype(tag);
    const cpu::LayerNormBackwardOf<T> p{
        .h = saved_input_.data<T>(), .dy = dy.data<T>(), .weight = data_or_null<T>(weight),
        .mean = saved_mean_.data<T>(), .rstd = saved_rstd_.data<T>(), .residual_grad = data_or_null<T>(residual_grad),
        .dx = dx.data<T>(), .dweight = data_or_null<T>(weight_grad), .dbias = data_or_null<T>(bias_grad), .rows = rows,
        .D = D};
    if constexpr (std::is_same_v<T, float>) cpu::layer_norm_backward(p);
    else cpu::reference::layer_norm_backward(p);
  });
  return dx;
}

Tensor LayerNorm::backward(const Tensor& dy) { return run_backward(dy, nullptr, kBackward); }

Tensor LayerNorm::backward_add(const Tensor& dy, const Tensor& residual_grad) {
  return run_backward(dy, &residual_grad, kBackwardAdd);
}

}  // namespace mha::nn
