// Module: gradients and parameter naming shared by every layer.
#include "mha/nn/module.h"

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

}  // namespace mha::nn
