// Module: gradients and parameter naming shared by every layer.
#include "mha/nn/module.h"

#include "check.h"

namespace mha::nn {

void Module::zero_grad() {
  for (NamedParameter& p : named_parameters()) p.grad->fill_(0.0);
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
