// ReLU and GELU, forward and backward, on the layer kernels (float32) or
// their reference loops (float64); formulas in cpu/reference/layers.cpp.
#include "mha/nn/activation.h"

#include "cpu/layers/layers.h"
#include "cpu/reference/layers.h"
#include "nn/layer_util.h"

namespace mha::nn {

namespace {

// y = f(x) over a float32/float64 tensor of any shape (rows of its last dim).
Tensor map(const Tensor& x_in, const char* fn, cpu::ActivationKind kind) {
  check_defined(x_in, fn, "x");
  check_layer_dtype(x_in.dtype(), fn);
  const Tensor x = x_in.contiguous();
  Tensor y = Tensor::empty(x.shape(), x.dtype());
  const int64_t cols = x.dim() > 0 ? x.size(-1) : 1, rows = cols > 0 ? x.numel() / cols : 0;
  if (x.dtype() == DType::float32)
    cpu::activation_forward(kind, x.data<float>(), nullptr, nullptr, y.data<float>(), rows, cols);
  else
    cpu::reference::activation_forward<double>(kind, x.data<double>(), nullptr, nullptr, y.data<double>(), rows, cols);
  return y;
}

// dx = dy · f'(x); with bias_grad, also bias_grad += Σ_rows dx.
Tensor chain(const Tensor& saved_x, const Tensor& dy_in, const char* fn, cpu::ActivationKind kind,
             Tensor* bias_grad = nullptr) {
  check_backward(saved_x, dy_in, saved_x.defined() ? saved_x.shape() : Shape{}, saved_x.dtype(), fn);
  const Tensor dy = dy_in.contiguous();
  Tensor dx = Tensor::empty(dy.shape(), dy.dtype());
  const int64_t cols = dy.dim() > 0 ? dy.size(-1) : 1, rows = cols > 0 ? dy.numel() / cols : 0;
  if (bias_grad) {
    check_defined(*bias_grad, fn, "bias_grad");
    if (bias_grad->shape() != Shape{cols} || !bias_grad->is_contiguous())
      raise<ShapeError>(fn, "bias_grad", "a contiguous (" + std::to_string(cols) + ",) tensor", shape_string(bias_grad->shape()));
    if (bias_grad->dtype() != dy.dtype()) raise<DtypeError>(fn, "bias_grad", to_string(dy.dtype()), to_string(bias_grad->dtype()));
  }
  if (dy.dtype() == DType::float32)
    cpu::activation_backward(kind, saved_x.data<float>(), dy.data<float>(), dx.data<float>(),
                             bias_grad ? bias_grad->data<float>() : nullptr, rows, cols);
  else
    cpu::reference::activation_backward<double>(kind, saved_x.data<double>(), dy.data<double>(), dx.data<double>(),
                                                bias_grad ? bias_grad->data<double>() : nullptr, rows, cols);
  return dx;
}

cpu::ActivationKind gelu_kind(GELU::Approximate a) {
  return a == GELU::Approximate::tanh ? cpu::ActivationKind::gelu_tanh : cpu::ActivationKind::gelu;
}

}  // namespace

Tensor ReLU::forward(const Tensor& x) {
  Tensor y = map(x, "mha::nn::ReLU::forward", cpu::ActivationKind::relu);
  saved_x_ = x.contiguous();
  return y;
}

Tensor ReLU::backward(const Tensor& dy) { return chain(saved_x_, dy, "mha::nn::ReLU::backward", cpu::ActivationKind::relu); }
Tensor ReLU::backward(const Tensor& dy, Tensor& bias_grad) {
  return chain(saved_x_, dy, "mha::nn::ReLU::backward", cpu::ActivationKind::relu, &bias_grad);
}

Tensor GELU::forward(const Tensor& x) {
  Tensor y = map(x, "mha::nn::GELU::forward", gelu_kind(approximate_));
  saved_x_ = x.contiguous();
  return y;
}

Tensor GELU::backward(const Tensor& dy) { return chain(saved_x_, dy, "mha::nn::GELU::backward", gelu_kind(approximate_)); }
Tensor GELU::backward(const Tensor& dy, Tensor& bias_grad) {
  return chain(saved_x_, dy, "mha::nn::GELU::backward", gelu_kind(approximate_), &bias_grad);
}

}  // namespace mha::nn
