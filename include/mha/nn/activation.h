// Element-wise activations with their derivatives. Saved for backward: x.
// backward(dy, bias_grad) also adds dx summed over rows into bias_grad (the
// gradient of a bias added just before the activation, a Linear's), in the
// same sweep: that Linear's backward then skips its own (bias_grad_added).
// An `out` dtype of bfloat16 (x and dy float32) rounds y or dx as they are
// stored: the operand a bf16-mixed Linear takes next, without a float32 copy
// and a rounding pass in between (bias_grad still sums dx unrounded).
//   ReLU: max(x, 0).
//   GELU: x·Φ(x) (exact, torch's default) or the tanh approximation
//         0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) (approximate="tanh").
#pragma once

#include "mha/nn/module.h"

namespace mha::nn {

// What ReLU and GELU share: y = f(x) elementwise, x saved for backward.
class Elementwise : public Module {
 public:
  Tensor forward(const Tensor& x) { return forward(x, x.dtype()); }
  Tensor forward(const Tensor& x, DType out);
  Tensor backward(const Tensor& dy) { return backward(dy, dy.dtype()); }
  Tensor backward(const Tensor& dy, DType out);
  Tensor backward(const Tensor& dy, Tensor& bias_grad) { return backward(dy, bias_grad, dy.dtype()); }
  Tensor backward(const Tensor& dy, Tensor& bias_grad, DType out);
  void release_activations() override { saved_x_ = Tensor(); }

 protected:
  enum class Function : uint8_t { relu, gelu, gelu_tanh };
  explicit Elementwise(Function f) : function_(f) {}

 private:
  Function function_;
  Tensor saved_x_;
};

class ReLU : public Elementwise {
 public:
  ReLU() : Elementwise(Function::relu) {}
};

class GELU : public Elementwise {
 public:
  enum class Approximate { none, tanh };
  explicit GELU(Approximate approximate = Approximate::none)
      : Elementwise(approximate == Approximate::tanh ? Function::gelu_tanh : Function::gelu) {}
};

}  // namespace mha::nn
