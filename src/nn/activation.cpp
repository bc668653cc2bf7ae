// ReLU and GELU, forward and backward, on the layer kernels (float32) or
// their reference loops (float64); formulas in cpu/reference/layers.cpp.
#include "mha/nn/activation.h"

#include "cpu/layers/layers.h"
#include "cpu/reference/layers.h"
#include "nn/layer_util.h"

namespace mha::nn {

namespace {

// The dtype of an output: the input's own, or bfloat16 from float32.
void check_output_dtype(DType in, DType out, const char* fn) {
  if (out != in && !(out == DType::bfloat16 && in == DType::float32))
    raise<DtypeError>(fn, "out", to_string(in) + " (the input's)" + (in == DType::float32 ? " or bfloat16" : ""),
                      to_string(out));
}

// y = f(x) over a float32/float64 tensor of any shape (rows of its last dim).
Tensor map(const Tensor& x_in, DType out, const char* fn, cpu::ActivationKind kind) {
  check_defined(x_in, fn, "x");
  check_layer_dtype(x_in.dtype(), fn);
  check_output_dtype(x_in.dtype(), out, fn);
  const Tensor x = x_in.contiguous();
  Tensor y = Tensor::empty(x.shape(), out);
  const int64_t cols = x.dim() > 0 ? x.size(-1) : 1, rows = cols > 0 ? x.numel() / cols : 0;
  if (out == DType::bfloat16)
    cpu::activation_forward(kind, x.data<float>(), nullptr, nullptr, y.data<bfloat16>(), rows, cols);
  else if (x.dtype() == DType::float32)
    cpu::activation_forward(kind, x.data<float>(), nullptr, nullptr, y.data<float>(), rows, cols);
  else
    cpu::reference::activation_forward<double>(kind, x.data<double>(), nullptr, nullptr, y.data<double>(), rows, cols);
  return y;
}

// dx = dy · f'(x); with bias_grad, also bias_grad += Σ_rows dx.
Tensor chain(const Tensor& saved_x, const Tensor& dy_in, DType out, const char* fn, cpu::ActivationKind kind,
             Tensor* bias_grad = nullptr) {
  check_backward(saved_x, dy_in, saved_x.defined() ? saved_x.shape() : Shape{}, saved_x.dtype(), fn);
  check_output_dtype(dy_in.dtype(), out, fn);
  const Tensor dy = dy_in.contiguous();
  Tensor dx = Tensor::empty(dy.shape(), out);
  const int64_t cols = dy.dim() > 0 ? dy.size(-1) : 1, rows = cols > 0 ? dy.numel() / cols : 0;
  if (bias_grad) {
    check_defined(*bias_grad, fn, "bias_grad");
    if (bias_grad->shape() != Shape{cols} || !bias_grad->is_contiguous())
      raise<ShapeError>(fn, "bias_grad", "a contiguous (" + std::to_string(cols) + ",) tensor", shape_string(bias_grad->shape()));
    if (bias_grad->dtype() != dy.dtype()) raise<DtypeError>(fn, "bias_grad", to_string(dy.dtype()), to_string(bias_grad->dtype()));
  }
  float* db = bias_grad && dy.dtype() == DType::float32 ? bias_grad->data<float>() : nullptr;
  if (out == DType::bfloat16)
    cpu::activation_backward(kind, saved_x.data<float>(), dy.data<float>(), dx.data<bfloat16>(), db, rows, cols);
  else if (dy.dtype() == DType::float32)
    cpu::activation_backward(kind, saved_x.data<float>(), dy.data<float>(), dx.data<float>(), db, rows, cols);
  else
    cpu::reference::activation_backward<double>(kind, saved_x.data<double>(), dy.data<double>(), dx.data<double>(),
                                                bias_grad ? bias_grad->data<double>() : nullptr, rows, cols);
  return dx;
}

// Error messages name the layer as users know it (by kind: relu, gelu, gelu_tanh).
constexpr const char* kForwardName[] = {"mha::nn::ReLU::forward", "mha::nn::GELU::forward", "mha::nn::GELU::forward"};
constexpr const char* kBackwardName[] = {"mha::nn::ReLU::backward", "mha::nn::GELU::backward",
                                         "mha::nn::GELU::backward"};

}  // namespace

Tensor Elementwise::forward(const Tensor& x, DType out) {
  // Function mirrors cpu::ActivationKind (the public header cannot name it).
  static_assert(uint8_t(Function::relu) == uint8_t(cpu::ActivationKind::relu) &&
                uint8_t(Function::gelu) == uint8_t(cpu::ActivationKind::gelu) &&
                uint8_t(Function::gelu_tanh) == uint8_t(cpu::ActivationKind::gelu_tanh));
  Tensor y = map(x, out, kForwardName[size_t(function_)], cpu::ActivationKind(function_));
  saved_x_ = x.contiguous();
  return y;
}

Tensor Elementwise::backward(const Tensor& dy, DType out) {
  return chain(saved_x_, dy, out, kBackwardName[size_t(function_)], cpu::ActivationKind(function_));
}

Tensor Elementwise::backward(const Tensor& dy, Tensor& bias_grad, DType out) {
  return chain(saved_x_, dy, out, kBackwardName[size_t(function_)], cpu::ActivationKind(function_), &bias_grad);
}

}  // namespace mha::nn
