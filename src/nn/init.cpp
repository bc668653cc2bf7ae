// Initialisation schemes (see the header for the formulas).
#include "mha/nn/init.h"

#include <cmath>

#include "check.h"

namespace mha::nn {

Init parse_init(const std::string& name) {
  if (name == "default") return Init::layer_default;
  if (name == "xavier") return Init::xavier;
  if (name == "he") return Init::he;
  if (name == "normal") return Init::normal;
  raise<ValueError>("mha::nn::parse_init", "name", "'default', 'xavier', 'he' or 'normal'", "'" + name + "'");
}

std::string to_string(Init init) {
  switch (init) {
    case Init::layer_default: return "default";
    case Init::xavier: return "xavier";
    case Init::he: return "he";
    case Init::normal: return "normal";
  }
  return "?";
}

void initialize(Module& module, Init scheme, Generator& gen, double normal_std) {
  if (scheme == Init::layer_default) return;
  if (!(normal_std > 0.0))
    raise<ValueError>("mha::nn::initialize", "normal_std", "> 0", std::to_string(normal_std));
  for (const NamedParameter& p : module.named_parameters()) {
    Tensor& w = *p.value;
    if (w.dim() < 2) continue;
    const double fan_out = double(w.size(0)), fan_in = double(w.numel() / w.size(0));
    if (scheme == Init::xavier) {
      const double a = std::sqrt(6.0 / (fan_in + fan_out));
      w.copy_(rand_uniform(w.shape(), gen, -a, a, DType::float64));
    } else {
      const double std = scheme == Init::he ? std::sqrt(2.0 / fan_in) : normal_std;
      w.copy_(randn(w.shape(), gen, 0.0, std, DType::float64));
    }
  }
}

}  // namespace mha::nn
