// Dropout: in training, each element is zeroed with probability p and the
// rest scaled by 1/(1-p); in evaluation, the identity. The pattern comes from
// Philox (seed drawn per forward from the layer's generator, element index),
// so backward regenerates it instead of storing a mask.
#pragma once

#include "mha/nn/module.h"
#include "mha/random.h"

namespace mha::nn {

class Dropout : public Module {
 public:
  Dropout(double p, Generator& gen);

  double p() const { return p_; }
  // Whether forward would zero and scale (training, p > 0) or pass x through.
  bool active() const { return training_ && p_ > 0; }
  Tensor forward(const Tensor& x);
  Tensor backward(const Tensor& dy);
  Generator& generator() { return gen_; }
  std::vector<NamedGenerator> named_generators() override { return {{"generator", &gen_}}; }

 private:
  double p_;
  Generator gen_;
  uint64_t seed_ = 0;
  bool applied_ = false;
};

}  // namespace mha::nn
