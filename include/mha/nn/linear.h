// Linear: y = x Wᵀ + b, as torch.nn.Linear.
//   x (…, in_features) → y (…, out_features); weight (out, in), bias (out).
//   Saved for backward: x (under bf16_mixed its bfloat16 copy, half the
//   memory: the dW product reads nothing more).
//   Under bf16_mixed, x may come as bfloat16 already (an activation's
//   rounded output), and so may backward's dy when bias_grad_added.
#pragma once

#include "mha/nn/module.h"
#include "mha/nn/precision.h"
#include "mha/random.h"

namespace mha::nn {

struct LinearConfig {
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = true;
  DType dtype = DType::float32;  // float32 or float64
  Precision precision = Precision::float32;  // bf16_mixed: x·Wᵀ, dX and dW with bfloat16 operands
};

class Linear : public Module {
 public:
  // torch's initialisation: weight and bias uniform in ±1/sqrt(in_features).
  Linear(const LinearConfig& config, Generator& gen);

  const LinearConfig& config() const { return config_; }
  std::vector<NamedParameter> named_parameters() override;

  Tensor forward(const Tensor& x);
  // bias_grad_added: bias_grad already holds this call's share (added by the
  // activation that took this layer's output, in its backward's sweep).
  Tensor backward(const Tensor& dy, bool bias_grad_added = false);
  void train(bool on = true) override;  // also drops the bfloat16 weight copy
  void release_activations() override { saved_x_ = Tensor(); }

  Tensor weight, bias, weight_grad, bias_grad;

 private:
  LinearConfig config_;
  Tensor saved_x_;
  Bf16Weights bf16_;
};

}  // namespace mha::nn
