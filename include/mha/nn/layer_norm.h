// LayerNorm over the last dim, as torch.nn.LayerNorm(normalized_shape=D):
//   y = (x - mean) / sqrt(var + eps) · weight + bias   (biased variance)
//   x (…, D) → y (…, D); weight, bias (D). Saved for backward: x̂ and 1/σ per row.
#pragma once

#include "mha/nn/module.h"

namespace mha::nn {

struct LayerNormConfig {
  int64_t normalized_shape = 0;
  double eps = 1e-5;
  bool elementwise_affine = true;
  DType dtype = DType::float32;  // float32 or float64
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(const LayerNormConfig& config);  // weight 1, bias 0

  const LayerNormConfig& config() const { return config_; }
  std::vector<NamedParameter> named_parameters() override;

  Tensor forward(const Tensor& x);
  Tensor backward(const Tensor& dy);
  void release_activations() override { saved_xhat_ = saved_rstd_ = Tensor(); }

  Tensor weight, bias, weight_grad, bias_grad;

 private:
  LayerNormConfig config_;
  Tensor saved_xhat_, saved_rstd_;
};

}  // namespace mha::nn
