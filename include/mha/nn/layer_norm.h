// LayerNorm over the last dim, as torch.nn.LayerNorm(normalized_shape=D):
//   y = (x - mean) / sqrt(var + eps) · weight + bias   (biased variance)
//   x (…, D) → y (…, D); weight, bias (D). Saved for backward: x (a
//   reference, no copy), and the mean and 1/σ of each row.
// forward_sum(x, residual) normalises h = x + residual and returns h too, in one
// sweep (a Pre-LN block's residual stream); backward_add(dy, residual_grad)
// returns dx + residual_grad (the residual path's gradient) in the same sweep.
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
  // y = norm(x + residual); *sum = x + residual (same shape and dtype as x).
  Tensor forward_sum(const Tensor& x, const Tensor& residual, Tensor* sum);
  // backward(dy) + residual_grad (shaped like dy).
  Tensor backward_add(const Tensor& dy, const Tensor& residual_grad);
  void release_activations() override { saved_input_ = saved_mean_ = saved_rstd_ = Tensor(); }

  Tensor weight, bias, weight_grad, bias_grad;

 private:
  LayerNormConfig config_;
  Tensor saved_input_, saved_mean_, saved_rstd_;
  Tensor run_forward(const Tensor& x, const Tensor* residual, Tensor* sum, const char* fn);
  Tensor run_backward(const Tensor& dy, const Tensor* residual_grad, const char* fn);
};

}  // namespace mha::nn
