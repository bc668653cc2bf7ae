// AdamW, SGD, gradient clipping and schedules (update rules in optim.h);
// AdamW and clipping of float32 parameters run on the layer kernels.
#include "mha/optim.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "cpu/layers/layers.h"
#include "cpu/reference/layers.h"
#include "nn/layer_util.h"

namespace mha::optim {

namespace {

// Calls f(T* value, T* grad, T* state0, T* state1, n) for a parameter of float32/float64.
template <class F>
void for_parameter(const nn::NamedParameter& p, Tensor* s0, Tensor* s1, F&& f) {
  nn::dispatch_float(p.value->dtype(), [&](auto tag) {
    using T = decltype(tag);
    f(p.value->data<T>(), p.grad->data<T>(), s0 ? s0->data<T>() : nullptr, s1 ? s1->data<T>() : nullptr,
      p.value->numel());
  });
}

void check_params(const std::vector<nn::NamedParameter>& params, const char* fn) {
  for (const nn::NamedParameter& p : params) {
    if (!p.value || !p.grad || !p.value->defined() || !p.grad->defined())
      raise<ShapeError>(fn, p.name, "a defined parameter and gradient", "an undefined one");
    nn::check_layer_dtype(p.value->dtype(), fn);
    if (p.grad->shape() != p.value->shape() || p.grad->dtype() != p.value->dtype() || !p.value->is_contiguous() ||
        !p.grad->is_contiguous())
      raise<ShapeError>(fn, p.name, "a contiguous gradient shaped like " + describe(*p.value), describe(*p.grad));
  }
}

}  // namespace

AdamW::AdamW(std::vector<nn::NamedParameter> params, const AdamWConfig& c) : params_(std::move(params)), config_(c) {
  const char* fn = "mha::optim::AdamW";
  check_params(params_, fn);
  if (!(c.lr >= 0)) raise<ValueError>(fn, "lr", ">= 0", std::to_string(c.lr));
  if (!(c.beta1 >= 0 && c.beta1 < 1)) raise<ValueError>(fn, "beta1", "in [0, 1)", std::to_string(c.beta1));
  if (!(c.beta2 >= 0 && c.beta2 < 1)) raise<ValueError>(fn, "beta2", "in [0, 1)", std::to_string(c.beta2));
  if (!(c.eps > 0)) raise<ValueError>(fn, "eps", "> 0", std::to_string(c.eps));
  if (!(c.weight_decay >= 0)) raise<ValueError>(fn, "weight_decay", ">= 0", std::to_string(c.weight_decay));
  if (const std::optional<nn::FlatParameters> flat = nn::flat_parameters_of(params_)) {
    flat_m_ = Tensor::zeros({flat->numel}, flat->values.dtype());
    flat_v_ = Tensor::zeros({flat->numel}, flat->values.dtype());
    for (size_t i = 0; i < params_.size(); ++i) {
      const int64_t at = flat->offsets[i], n = params_[i].value->numel();
      m_.push_back(flat_m_.slice(0, at, at + n).view(params_[i].value->shape()));
      v_.push_back(flat_v_.slice(0, at, at + n).view(params_[i].value->shape()));
    }
    return;
  }
  for (const nn::NamedParameter& p : params_) {
    m_.push_back(Tensor::zeros(p.value->shape(), p.value->dtype()));
    v_.push_back(Tensor::zeros(p.value->shape(), p.value->dtype()));
  }
}

void AdamW::step() {
  ++steps_;
  const double bias1 = 1 - std::pow(config_.beta1, double(steps_)), bias2 = 1 - std::pow(config_.beta2, double(steps_));
  const auto update = [&](auto* p, auto* g, auto* m, auto* v, int64_t n) {
    using T = std::remove_pointer_t<decltype(p)>;
    const cpu::AdamWStepOf<T> s{.param = p, .exp_avg = m, .exp_avg_sq = v, .grad = g, .n = n, .lr = config_.lr,
                                .beta1 = config_.beta1, .beta2 = config_.beta2, .eps = config_.eps,
                                .weight_decay = config_.weight_decay, .bias1 = bias1, .bias2 = bias2};
    if constexpr (std::is_same_v<T, float>) cpu::adamw_step(s);
    else cpu::reference::adamw_step(s);
  };
  std::optional<nn::FlatParameters> flat =
      flat_m_.defined() ? nn::flat_parameters_of(params_) : std::optional<nn::FlatParameters>{};
  if (flat && flat->numel == flat_m_.numel())  // one sweep over every parameter
    return for_parameter({"", &flat->values, &flat->grads}, &flat_m_, &flat_v_, update);
  for (size_t i = 0; i < params_.size(); ++i) for_parameter(params_[i], &m_[i], &v_[i], update);
}

SGD::SGD(std::vector<nn::NamedParameter> params, const SGDConfig& c) : params_(std::move(params)), config_(c) {
  const char* fn = "mha::optim::SGD";
  check_params(params_, fn);
  if (!(c.lr >= 0)) raise<ValueError>(fn, "lr", ">= 0", std::to_string(c.lr));
  if (!(c.momentum >= 0)) raise<ValueError>(fn, "momentum", ">= 0", std::to_string(c.momentum));
  if (c.nesterov && (c.momentum <= 0 || c.dampening != 0))
    raise<ValueError>(fn, "nesterov", "momentum > 0 and dampening = 0", "momentum " + std::to_string(c.momentum));
  for (const nn::NamedParameter& p : params_) buffers_.push_back(Tensor::zeros(p.value->shape(), p.value->dtype()));
}

void SGD::step() {
  ++steps_;
  const SGDConfig& c = config_;
  for (size_t i = 0; i < params_.size(); ++i)
    for_parameter(params_[i], &buffers_[i], nullptr, [&](auto* p, auto* g, auto* b, auto*, int64_t n) {
      using T = std::remove_pointer_t<decltype(p)>;
      for (int64_t k = 0; k < n; ++k) {
        double d = double(g[k]) + c.weight_decay * double(p[k]);
        if (c.momentum > 0) {
          b[k] = T(steps_ == 1 ? d : c.momentum * double(b[k]) + (1 - c.dampening) * d);
          d = c.nesterov ? d + c.momentum * double(b[k]) : double(b[k]);
        }
        p[k] = T(double(p[k]) - c.lr * d);
      }
    });
}

double clip_grad_norm(const std::vector<nn::NamedParameter>& params, double max_norm) {
  const char* fn = "mha::optim::clip_grad_norm";
  check_params(params, fn);
  if (!(max_norm > 0)) raise<ValueError>(fn, "max_norm", "> 0", std::to_string(max_norm));
  // Flat parameters: their gradient block as one parameter (its gaps are 0).
  std::optional<nn::FlatParameters> flat = nn::flat_parameters_of(params);
  std::vector<nn::NamedParameter> whole;
  if (flat) whole.push_back({"", &flat->grads, &flat->grads});
  const std::vector<nn::NamedParameter>& sweep = flat ? whole : params;
  double sq = 0;
  for (const nn::NamedParameter& p : sweep)
    for_parameter(p, nullptr, nullptr, [&](auto*, auto* g, auto*, auto*, int64_t n) {
      using T = std::remove_pointer_t<decltype(g)>;
      if constexpr (std::is_same_v<T, float>) sq += cpu::sum_of_squares(g, n);
      else
        for (int64_t k = 0; k < n; ++k) sq += g[k] * g[k];
    });
  const double norm = std::sqrt(sq);
  if (norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);
    for (const nn::NamedParameter& p : sweep)
      for_parameter(p, nullptr, nullptr, [&](auto*, auto* g, auto*, auto*, int64_t n) {
        using T = std::remove_pointer_t<decltype(g)>;
        if constexpr (std::is_same_v<T, float>) cpu::scale_in_place(g, n, float(scale));
        else
          for (int64_t k = 0; k < n; ++k) g[k] *= scale;
      });
  }
  return norm;
}

double warmup_cosine(int64_t step, int64_t warmup, int64_t total, double base_lr, double min_lr) {
  if (warmup > 0 && step < warmup) return base_lr * double(step + 1) / double(warmup);
  if (step >= total) return min_lr;
  const double progress = double(step - warmup) / double(std::max<int64_t>(1, total - warmup));
  return min_lr + 0.5 * (base_lr - min_lr) * (1 + std::cos(3.141592653589793 * progress));
}

double noam(int64_t step, int64_t d_model, int64_t warmup, double factor) {
  const double s = double(step + 1);
  return factor * std::pow(double(d_model), -0.5) * std::min(std::pow(s, -0.5), s * std::pow(double(warmup), -1.5));
}

}  // namespace mha::optim
