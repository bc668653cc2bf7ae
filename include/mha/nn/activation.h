// Element-wise activations with their derivatives. Saved for backward: x.
// backward(dy, bias_grad) also adds dx summed over rows into bias_grad (the
// gradient of a bias added just before the activation, a Linear's), in the
// same sweep: that Linear's backward then skips its own (bias_grad_added).
//   ReLU: max(x, 0).
//   GELU: x·Φ(x) (exact, torch's default) or the tanh approximation
//         0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) (approximate="tanh").
#pragma once

#include "mha/nn/module.h"

namespace mha::nn {

class ReLU : public Module {
 public:
  Tensor forward(const Tensor& x);
  Tensor backward(const Tensor& dy);
  Tensor backward(const Tensor& dy, Tensor& bias_grad);
  void release_activations() override { saved_x_ = Tensor(); }

 private:
  Tensor saved_x_;
};

class GELU : public Module {
 public:
  enum class Approximate { none, tanh };
  explicit GELU(Approximate approximate = Approximate::none) : approximate_(approximate) {}

  Tensor forward(const Tensor& x);
  Tensor backward(const Tensor& dy);
  Tensor backward(const Tensor& dy, Tensor& bias_grad);
  void release_activations() override { saved_x_ = Tensor(); }

 private:
  Approximate approximate_;
  Tensor saved_x_;
};

}  // namespace mha::nn
