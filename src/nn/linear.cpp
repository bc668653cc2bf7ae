// Linear: y = x Wᵀ + b through BLAS; backward dW += dyᵀ x, db += Σ dy, dx = dy W.
// Under bf16_mixed the three products take bfloat16 operands (x, W, dy
// rounded) and sum in float32; db sums the float32 dy. There x may come
// already rounded (bfloat16), and dy too when db is summed elsewhere.
#include "mha/nn/linear.h"

#include <cmath>

#include "cpu/gemm.h"
#include "nn/mixed_precision.h"

namespace mha::nn {

namespace {
constexpr const char* kCtor = "mha::nn::Linear";
constexpr const char* kForward = "mha::nn::Linear::forward";
constexpr const char* kBackward = "mha::nn::Linear::backward";
}  // namespace

Linear::Linear(const LinearConfig& c, Generator& gen) : config_(c) {
  if (c.in_features <= 0) raise<ValueError>(kCtor, "in_features", "> 0", std::to_string(c.in_features));
  if (c.out_features <= 0) raise<ValueError>(kCtor, "out_features", "> 0", std::to_string(c.out_features));
  check_layer_dtype(c.dtype, kCtor);
  check_precision(c.dtype, c.precision, kCtor);
  const double bound = 1.0 / std::sqrt(double(c.in_features));
  weight = rand_uniform({c.out_features, c.in_features}, gen, -bound, bound, c.dtype);
  weight_grad = Tensor::zeros(weight.shape(), c.dtype);
  if (c.bias) {
    bias = rand_uniform({c.out_features}, gen, -bound, bound, c.dtype);
    bias_grad = Tensor::zeros(bias.shape(), c.dtype);
  }
}

std::vector<NamedParameter> Linear::named_parameters() {
  std::vector<NamedParameter> out{{"weight", &weight, &weight_grad}};
  if (bias.defined()) out.push_back({"bias", &bias, &bias_grad});
  return out;
}

void Linear::train(bool on) {
  Module::train(on);
  bf16_.clear();
}

Tensor Linear::forward(const Tensor& x) {
  check_input(x, kForward, "x", accepted_dtype(x, config_.dtype, config_.precision), config_.in_features);
  const int64_t in = config_.in_features, out = config_.out_features, rows = x.numel() / in;
  Shape shape = x.shape();
  shape.back() = out;
  Tensor y = Tensor::empty(shape, config_.dtype);
  dispatch_products(config_.dtype, config_.precision, [&](auto tag, auto operand_tag) {
    using T = decltype(tag);
    using A = decltype(operand_tag);
    saved_x_ = as_operand<A>(x);
    const Tensor& w = weight_operand<A>(weight, bf16_, 0, training_);
    cpu::gemm_bias(false, true, rows, out, in, saved_x_.data<A>(), in, w.data<A>(), in,
                   bias.defined() ? bias.data<T>() : nullptr, y.data<T>(), out);
  });
  return y;
}

Tensor Linear::backward(const Tensor& dy_in, bool bias_grad_added) {
  const int64_t in = config_.in_features, out = config_.out_features;
  Shape out_shape = saved_x_.defined() ? saved_x_.shape() : Shape{};
  if (!out_shape.empty()) out_shape.back() = out;
  // A bfloat16 dy (bf16-mixed) serves the products; the bias gradient needs it unrounded.
  const bool need_bias_dy = bias.defined() && !bias_grad_added;
  check_backward(saved_x_, dy_in, out_shape, accepted_dtype(dy_in, config_.dtype, config_.precision, !need_bias_dy),
                 kBackward);
  const Tensor dy = dy_in.contiguous();
  const int64_t rows = dy.numel() / out;
  Tensor dx = Tensor::empty(saved_x_.shape(), config_.dtype);
  dispatch_products(config_.dtype, config_.precision, [&](auto tag, auto operand_tag) {
    using T = decltype(tag);
    using A = decltype(operand_tag);
    const Tensor d = as_operand<A>(dy);
    const Tensor& w = weight_operand<A>(weight, bf16_, 0, false);
    cpu::gemm(true, false, out, in, rows, T(1), d.data<A>(), out, saved_x_.data<A>(), in, T(1), weight_grad.data<T>(), in);
    if (need_bias_dy) add_bias_gradient(dy.data<T>(), rows, out, bias_grad.data<T>());
    cpu::gemm(false, false, rows, in, out, T(1), d.data<A>(), out, w.data<A>(), in, T(0), dx.data<T>(), in);
  });
  return dx;
}

}  // namespace mha::nn
