// Precision names, bfloat16 copies of activations and the weight cache.
#include "nn/mixed_precision.h"

#include "cpu/layers/layers.h"

namespace mha::nn {

Precision parse_precision(const std::string& name) {
  if (name == "float32") return Precision::float32;
  if (name == "bf16-mixed") return Precision::bf16_mixed;
  raise<ValueError>("mha::nn::parse_precision", "name", "float32 or bf16-mixed", "'" + name + "'");
}

std::string to_string(Precision precision) { return precision == Precision::bf16_mixed ? "bf16-mixed" : "float32"; }

namespace {

// out (bfloat16, contiguous, x's shape) = x rounded.
void round_into(const Tensor& x_in, Tensor& out) {
  if (x_in.dtype() != DType::float32) return out.copy_(x_in);
  const Tensor x = x_in.contiguous();
  cpu::round_to_bf16(x.data<float>(), out.data<bfloat16>(), x.numel());
}

}  // namespace

Tensor bf16_copy(const Tensor& x) {
  Tensor out = Tensor::empty(x.shape(), DType::bfloat16);
  round_into(x, out);
  return out;
}

const Tensor& Bf16Weights::get(size_t slot, const Tensor& weight, bool refresh) {
  if (copies_.size() <= slot) copies_.resize(slot + 1);
  Copy& c = copies_[slot];
  const bool fits = c.bf16.defined() && c.bf16.shape() == weight.shape();
  if (!fits) c.bf16 = Tensor::empty(weight.shape(), DType::bfloat16);
  if (refresh || !fits || c.source != weight.raw_data()) round_into(weight, c.bf16);
  c.source = weight.raw_data();
  return c.bf16;
}

}  // namespace mha::nn
