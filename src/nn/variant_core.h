// The attention core of a MultiheadAttention whose AttentionVariant is one
// of the efficient variants (not full or window, which run attention_forward):
// per-head q, k, v in, per-head outputs out, and the backward that inverts it.
#pragma once

#include "mha/nn/attention_variant.h"
#include "mha/variants.h"

namespace mha::nn {

struct VariantCall {
  const AttentionVariant* variant = nullptr;
  bool causal = false;
  Tensor key_projection, value_projection;  // linformer: (k, max_length) parameters
  uint64_t feature_seed = 0;                // performer: the current draw
};

// What the backward needs; the inputs are kept as contiguous (N, H, ·, hd).
struct VariantSaved {
  VariantCall call;
  Tensor q, k, v;
  BlockSparseOptions sparse;
  BlockSparseOutput sparse_out;
  LinearAttentionOptions linear;
  PerformerOptions performer;
  LinearAttentionOutput kernel_out;  // linear and performer
  LinformerOptions linformer;
  LinformerOutput linformer_out;
  LshOptions lsh;
  LshOutput lsh_out;
  AxialOutput axial_out;
};

struct VariantGradients {
  Tensor dq, dk, dv;                                  // (N, H, ·, hd); dk is zero for lsh (shared QK)
  Tensor dkey_projection, dvalue_projection;          // linformer: (k, max_length), zero past S
};

// q (N, H, L, hd), k and v (N, H, S, hd), any strides → out (N, H, L, hd).
// Typed errors from `fn` when the variant cannot take these shapes.
Tensor variant_forward(const char* fn, const VariantCall& call, const Tensor& q, const Tensor& k, const Tensor& v,
                       VariantSaved& saved);
VariantGradients variant_backward(const VariantSaved& saved, const Tensor& dout);

}  // namespace mha::nn
