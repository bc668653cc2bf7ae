// Linear: y = x Wᵀ + b, as torch.nn.Linear.
//   x (…, in_features) → y (…, out_features); weight (out, in), bias (out).
//   Saved for backward: x.
#pragma once

#include "mha/nn/module.h"
#include "mha/random.h"

namespace mha::nn {

struct LinearConfig {
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = true;
  DType dtype = DType::float32;  // float32 or float64
};

class Linear : public Module {
 public:
  // torch's initialisation: weight and bias uniform in ±1/sqrt(in_features).
  Linear(const LinearConfig& config, Generator& gen);

  const LinearConfig& config() const { return config_; }
  std::vector<NamedParameter> named_parameters() override;

  Tensor forward(const Tensor& x);
  Tensor backward(const Tensor& dy);
  void release_activations() override { saved_x_ = Tensor(); }

  Tensor weight, bias, weight_grad, bias_grad;

 private:
  LinearConfig config_;
  Tensor saved_x_;
};

}  // namespace mha::nn
