// Mixed precision inside the layers (Precision in mha/nn/precision.h): the
// operand type of the matrix products and bfloat16 copies of activations.
#pragma once

#include <type_traits>

#include "mha/nn/precision.h"
#include "nn/layer_util.h"

namespace mha::nn {

// A float32 or float64 layer may compute in its dtype; bf16_mixed needs float32.
inline void check_precision(DType dtype, Precision precision, const char* fn) {
  if (precision == Precision::bf16_mixed && dtype != DType::float32)
    raise<DtypeError>(fn, "dtype", "float32 under bf16-mixed precision (float32 master weights)", to_string(dtype));
}

// Calls f(T{}, A{}): T the layer's dtype, A the type of the products'
// operands: T itself, or bfloat16 under bf16_mixed (then T is float).
template <class F>
void dispatch_products(DType dtype, Precision precision, F&& f) {
  if (dtype == DType::float64) f(double{}, double{});
  else if (precision == Precision::bf16_mixed) f(float{}, bfloat16{});
  else f(float{}, float{});
}

// The dtype of the products' operands for a layer.
inline DType operand_dtype(DType dtype, Precision precision) {
  return precision == Precision::bf16_mixed ? DType::bfloat16 : dtype;
}

// A contiguous bfloat16 copy of x (float32 or bfloat16), rounded to nearest even.
Tensor bf16_copy(const Tensor& x);

// x as an operand of type A: x itself (contiguous) when A is its type, else
// its bfloat16 copy.
template <class A>
Tensor as_operand(const Tensor& x) {
  if constexpr (std::is_same_v<A, bfloat16>) return x.dtype() == DType::bfloat16 ? x.contiguous() : bf16_copy(x);
  else return x.contiguous();
}

// The dtype a layer's input or gradient must have: the layer's, or under
// bf16_mixed also bfloat16 when `operand_ok` (the products' operand, rounded
// by the layer before: see activation.h).
inline DType accepted_dtype(const Tensor& x, DType dtype, Precision precision, bool operand_ok = true) {
  return operand_ok && precision == Precision::bf16_mixed && x.dtype() == DType::bfloat16 ? DType::bfloat16 : dtype;
}

// A weight as an operand of type A: the float tensor itself, or its bfloat16
// copy from `cache` (made afresh when `refresh`; see Bf16Weights).
template <class A>
const Tensor& weight_operand(const Tensor& weight, Bf16Weights& cache, size_t slot, bool refresh) {
  if constexpr (std::is_same_v<A, bfloat16>) return cache.get(slot, weight, refresh);
  else return weight;
}

}  // namespace mha::nn
