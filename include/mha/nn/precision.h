// Precision of a layer's matrix products: its own dtype, or bfloat16
// operands with float32 accumulation ("bf16-mixed").
//
// Under bf16_mixed the parameters stay float32 (the master weights: the
// optimizer updates them and their gradients are float32), and so do the
// tensors between layers. Only the operands of the matrix products are
// rounded to bfloat16 (round to nearest even): Linear's x·Wᵀ, dX and dW
// products, MultiheadAttention's projections and its attention core (the
// fused kernel's bfloat16 path). Every product sums in float32. LayerNorm,
// softmax statistics, residual adds, biases, the loss and the optimizer
// stay float32. Docs: docs/design.md, "Mixed precision".
#pragma once

#include <string>
#include <vector>

#include "mha/tensor.h"

namespace mha::nn {

enum class Precision : uint8_t {
  float32,     // products in the layer's dtype (float32, or float64 for a float64 layer)
  bf16_mixed,  // bfloat16 operands, float32 sums; needs a float32 layer
};

Precision parse_precision(const std::string& name);  // "float32" or "bf16-mixed"; else ValueError
std::string to_string(Precision precision);

// The bfloat16 copies of a layer's weights under bf16_mixed, one per slot.
// A forward in training mode makes them afresh (the optimizer changes the
// weights between steps: once per forward costs O(weights), ~1/(B·L) of the
// products) and its backward uses the same copies. In eval mode a copy is
// kept from call to call (decoding reuses it token after token) until the
// layer's train() or eval() is called (clear()) or the weight tensor is
// replaced by another one.
class Bf16Weights {
 public:
  Bf16Weights() = default;
  // A copied layer makes copies of its own: refreshing one in place must not
  // change another layer's.
  Bf16Weights(const Bf16Weights&) {}
  Bf16Weights& operator=(const Bf16Weights&) {
    copies_.clear();
    return *this;
  }
  Bf16Weights(Bf16Weights&&) = default;
  Bf16Weights& operator=(Bf16Weights&&) = default;

  // bfloat16 (contiguous) copy of the float32 `weight` held in `slot`.
  const Tensor& get(size_t slot, const Tensor& weight, bool refresh);
  void clear() { copies_.clear(); }

 private:
  struct Copy {
    const void* source = nullptr;
    Tensor bf16;
  };
  std::vector<Copy> copies_;
};

}  // namespace mha::nn
