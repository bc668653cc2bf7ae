// Module: gradients and parameter naming shared by every layer.
#include "mha/nn/module.h"

#include "check.h"

namespace mha::nn {

void Module::zero_grad() {
  for (NamedParameter& p : named_parameters()) p.grad->fill_(0.0);
}

namespace {

constexpr int64_t kAlign = 16;  // elements between parameter starts: a multiple of 16 (64 bytes of float32)

int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// The start of t's storage (its data minus its offset).
const char* storage_base(const Tensor& t) {
  return static_cast<const char*>(t.raw_data()) - t.offset() * dtype_size(t.dtype());
}

}  // namespace

FlatParameters flatten_parameters(const std::vector<NamedParameter>& params) {
  const char* fn = "mha::nn::flatten_parameters";
  FlatParameters flat;
  if (params.empty()) return flat;
  const DType dtype = params[0].value->dtype();
  if (dtype != DType::float32 && dtype != DType::float64)
    raise<DtypeError>(fn, params[0].name, "float32 or float64", to_string(dtype));
  for (const NamedParameter& p : params) {
    if (!p.value->defined() || !p.grad->defined() || p.value->dtype() != dtype || p.grad->dtype() != dtype ||
        p.grad->shape() != p.value->shape())
      raise<DtypeError>(fn, p.name, "a defined " + to_string(dtype) + " parameter with a gradient of its shape",
                        describe(*p.value));
    flat.offsets.push_back(flat.numel);
    flat.numel += aligned(p.value->numel());
  }
  flat.values = Tensor::zeros({flat.numel}, dtype);
  flat.grads = Tensor::zeros({flat.numel}, dtype);
  for (size_t i = 0; i < params.size(); ++i) {
    const NamedParameter& p = params[i];
    const int64_t n = p.value->numel(), at = flat.offsets[i];
    Tensor value = flat.values.slice(0, at, at + n).view(p.value->shape());
    Tensor grad = flat.grads.slice(0, at, at + n).view(p.value->shape());
    value.copy_(*p.value);
    grad.copy_(*p.grad);
    *p.value = value, *p.grad = grad;
  }
  return flat;
}

std::optional<FlatParameters> flat_parameters_of(const std::vector<NamedParameter>& params) {
  if (params.empty()) return std::nullopt;
  const Tensor& v0 = *params[0].value;
  const Tensor& g0 = *params[0].grad;
  if (!v0.defined() || !g0.defined()) return std::nullopt;
  FlatParameters flat;
  const int64_t first_v = v0.offset(), first_g = g0.offset();
  for (const NamedParameter& p : params) {
    const Tensor &v = *p.value, &g = *p.grad;
    if (!v.defined() || !g.defined() || v.dtype() != v0.dtype() || g.dtype() != v0.dtype() || !v.is_contiguous() ||
        !g.is_contiguous() || storage_base(v) != storage_base(v0) || storage_base(g) != storage_base(g0) ||
        v.offset() - first_v != flat.numel || g.offset() - first_g != flat.numel)
      return std::nullopt;
    flat.offsets.push_back(flat.numel);
    flat.numel += aligned(v.numel());
  }
  // The sweep covers the last parameter's padding too: it must be in the blocks.
  const Tensor& last_v = *params.back().value;
  flat.numel -= aligned(last_v.numel()) - last_v.numel();
  flat.values = Tensor::from_blob(const_cast<void*>(v0.raw_data()), {flat.numel}, {1}, v0.dtype(), nullptr);
  flat.grads = Tensor::from_blob(const_cast<void*>(g0.raw_data()), {flat.numel}, {1}, v0.dtype(), nullptr);
  return flat;
}

namespace {
thread_local GradientsReadyScope* innermost_scope = nullptr;
}  // namespace

GradientsReadyScope::GradientsReadyScope(GradientsReady on_ready)
    : on_ready_(std::move(on_ready)), outer_(innermost_scope) {
  innermost_scope = this;
}
GradientsReadyScope::~GradientsReadyScope() { innermost_scope = outer_; }

void report_gradients_ready(Module& module) {
  if (innermost_scope) innermost_scope->on_ready_(module.named_parameters());
}

void append_parameters(std::vector<NamedParameter>& out, const std::string& prefix, Module& child) {
  for (NamedParameter& p : child.named_parameters()) out.push_back({prefix + "." + p.name, p.value, p.grad});
}

void append_generators(std::vector<NamedGenerator>& out, const std::string& prefix, Module& child) {
  for (NamedGenerator& g : child.named_generators()) out.push_back({prefix + "." + g.name, g.generator});
}

std::vector<Generator> generator_states(Module& module) {
  std::vector<Generator> out;
  for (NamedGenerator& g : module.named_generators()) out.push_back(*g.generator);
  return out;
}

void set_generator_states(Module& module, const std::vector<Generator>& states) {
  const std::vector<NamedGenerator> generators = module.named_generators();
  if (generators.size() != states.size())
    raise<ValueError>("mha::nn::set_generator_states", "states", std::to_string(generators.size()) + " generators",
                      std::to_string(states.size()));
  for (size_t i = 0; i < states.size(); ++i) *generators[i].generator = states[i];
}

}  // namespace mha::nn
