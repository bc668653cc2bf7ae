// The layer interface: parameters with their gradients, and the mode.
//
// Every layer is a forward/backward pair: forward(x) saves what backward
// needs (from the last call); backward(dy) returns the input's gradient and
// ADDS into each parameter's gradient, so gradients accumulate across calls
// until zero_grad().
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "mha/random.h"
#include "mha/tensor.h"

namespace mha::nn {

// A parameter and its gradient (same shape and dtype), named as in torch.
struct NamedParameter {
  std::string name;
  Tensor* value;
  Tensor* grad;
};

// A random generator inside a layer (dropout), named like parameters: its
// state is part of a training run's state (exact resume).
struct NamedGenerator {
  std::string name;
  Generator* generator;
};

class Module {
 public:
  virtual ~Module() = default;

  // Parameters in torch's order and names (children prefixed "child.").
  virtual std::vector<NamedParameter> named_parameters() { return {}; }
  // The layer's random generators (children prefixed "child."), in a fixed order.
  virtual std::vector<NamedGenerator> named_generators() { return {}; }
  void zero_grad();

  // Training mode: dropout active. Containers pass the mode to children.
  virtual void train(bool on = true) { training_ = on; }
  // Frees what the last forward saved for backward (activation
  // checkpointing); a backward then needs another forward. Containers pass
  // it to children.
  virtual void release_activations() {}
  void eval() { train(false); }
  bool is_training() const { return training_; }

 protected:
  bool training_ = true;
};

// Backward's progress, for code that acts on gradients as soon as they are
// final (data-parallel training all-reduces a bucket of them while backward
// goes on). While a GradientsReadyScope lives on this thread, the layer
// stacks (transformer_stack.h) report each layer's parameters right after its
// backward; parameters outside the layers are not reported (they are final
// when backward returns). Scopes nest; the innermost one is called.
using GradientsReady = std::function<void(const std::vector<NamedParameter>&)>;
class GradientsReadyScope {
 public:
  explicit GradientsReadyScope(GradientsReady on_ready);
  ~GradientsReadyScope();
  GradientsReadyScope(const GradientsReadyScope&) = delete;
  GradientsReadyScope& operator=(const GradientsReadyScope&) = delete;

 private:
  friend void report_gradients_ready(Module& module);
  GradientsReady on_ready_;
  GradientsReadyScope* outer_;
};
// Reports module's parameters to this thread's innermost scope (none: nothing).
void report_gradients_ready(Module& module);

// Appends child's parameters under "prefix.".
void append_parameters(std::vector<NamedParameter>& out, const std::string& prefix, Module& child);
// Appends child's generators under "prefix.".
void append_generators(std::vector<NamedGenerator>& out, const std::string& prefix, Module& child);

// One contiguous block for every parameter's value and one for every
// gradient (llm.c's layout): flatten_parameters copies each value and
// gradient into its place, parameter i starting at offsets[i] (a multiple of
// 16 elements, so every parameter starts on a 64-byte boundary; the gaps
// hold zeros), and makes the parameters' tensors views of the blocks. An
// optimizer or a norm then sweeps `numel` elements once instead of each
// tensor in turn (optim.h). All parameters of one dtype, float32 or float64.
struct FlatParameters {
  Tensor values, grads;  // (numel)
  std::vector<int64_t> offsets;
  int64_t numel = 0;
};
FlatParameters flatten_parameters(const std::vector<NamedParameter>& params);
// The blocks that params already are views of, in order and laid out as
// flatten_parameters lays them; nullopt when they are not.
std::optional<FlatParameters> flat_parameters_of(const std::vector<NamedParameter>& params);

// The states of module's generators (named_generators order), and setting
// them back: a forward run again from the same states draws the same dropout.
std::vector<Generator> generator_states(Module& module);
void set_generator_states(Module& module, const std::vector<Generator>& states);

}  // namespace mha::nn
