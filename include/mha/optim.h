// Optimizers, gradient clipping and learning-rate schedules, with torch's
// update rules (torch.optim.AdamW, torch.optim.SGD, clip_grad_norm_).
//
//   AdamW (decoupled weight decay):  p ← p·(1 - lr·wd)
//     m ← β1·m + (1-β1)·g,  v ← β2·v + (1-β2)·g²
//     p ← p - lr · (m / (1-β1^t)) / (sqrt(v / (1-β2^t)) + eps)
//   SGD:  g ← g + wd·p;  b ← μ·b + (1-dampening)·g (b = g at the first step);
//         g ← nesterov ? g + μ·b : b;  p ← p - lr·g
#pragma once

#include <vector>

#include "mha/nn/module.h"

namespace mha::optim {

struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

// When the parameters are laid out as nn::flatten_parameters lays them, the
// moments are two blocks of the same layout and a step is one sweep over all
// of them; otherwise one sweep per parameter. The two give the same numbers.
class AdamW {
 public:
  AdamW(std::vector<nn::NamedParameter> params, const AdamWConfig& config);
  void step();  // one update from the current gradients
  void set_lr(double lr) { config_.lr = lr; }
  double lr() const { return config_.lr; }
  int64_t steps() const { return steps_; }
  // State for checkpoints: exp_avg and exp_avg_sq per parameter, in order.
  std::vector<Tensor>& exp_avg() { return m_; }
  std::vector<Tensor>& exp_avg_sq() { return v_; }
  void set_steps(int64_t steps) { steps_ = steps; }

 private:
  std::vector<nn::NamedParameter> params_;
  AdamWConfig config_;
  std::vector<Tensor> m_, v_;    // views of flat_m_, flat_v_ when those are defined
  Tensor flat_m_, flat_v_;       // (numel) for flat parameters
  int64_t steps_ = 0;
};

struct SGDConfig {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

class SGD {
 public:
  SGD(std::vector<nn::NamedParameter> params, const SGDConfig& config);
  void step();
  void set_lr(double lr) { config_.lr = lr; }
  double lr() const { return config_.lr; }
  std::vector<Tensor>& momentum_buffer() { return buffers_; }

 private:
  std::vector<nn::NamedParameter> params_;
  SGDConfig config_;
  std::vector<Tensor> buffers_;
  int64_t steps_ = 0;
};

// Scales all gradients by max_norm / (norm + 1e-6) when their global L2 norm
// exceeds max_norm; returns the norm before clipping. Flat parameters
// (nn::flatten_parameters): one sweep over the gradient block each way.
double clip_grad_norm(const std::vector<nn::NamedParameter>& params, double max_norm);

// Linear warm-up over `warmup` steps to base_lr, then cosine decay to min_lr at
// `total` steps (constant after). step counts from 0.
double warmup_cosine(int64_t step, int64_t warmup, int64_t total, double base_lr, double min_lr = 0.0);
// The Transformer paper's schedule: d_model^-0.5 · min((step+1)^-0.5, (step+1)·warmup^-1.5), times factor.
double noam(int64_t step, int64_t d_model, int64_t warmup, double factor = 1.0);

}  // namespace mha::optim
