// What a MultiheadAttention hands its attention core and takes back, in
// torch's conventions: the user's masks as one mask, the additive attn_bias
// and its gradient, and the returned weights averaged over the heads (and
// their gradient spread back over the heads).
#pragma once

#include <cstdint>

#include "mha/nn/multihead_attention.h"

namespace mha::nn {

// The user's attn_mask and key_padding_mask as one mask for the attention
// core, shaped (N or 1, H or 1, L or 1, S_total): bool (true = may attend)
// when both are bool or absent and not force_additive, else additive in
// `dtype`. Columns added for bias_k / zero attention are always visible.
Tensor combine_masks(const char* fn, const MultiheadAttentionInputs& in, int64_t N, int64_t H, int64_t L, int64_t S,
                     int64_t S_total, bool batched, DType dtype, bool force_additive);

// attn_bias (1 or N, H, L, S) in the module's dtype (float by construction).
void check_attn_bias(const char* fn, const Tensor& bias, int64_t N, int64_t H, int64_t L, int64_t S, DType dtype);

// The additive mask (Nm, Hm, Lm, S_total) or none, plus bias (Nb, H, L, S) on
// its first S columns: (max(Nm, Nb), H, L, S_total).
Tensor add_bias(const Tensor& mask, const Tensor& bias, int64_t S_total);

// The bias's gradient from that of the mask add_bias made: its first S
// columns, summed over the batch dim when the bias broadcast over it.
Tensor bias_gradient(const Tensor& dmask, const Shape& bias_shape);

// The heads' weights (N, H, L, S) averaged over H: (N, L, S) in float64.
Tensor average_heads(const Tensor& weights, int64_t N, int64_t H, int64_t L, int64_t S);

// The heads' weights gradient (N, H, L, S) in `dtype` from that of the
// returned weights: per head as they are, or averaged over the heads (each
// head's weights entered the mean with 1/H).
Tensor heads_weights_gradient(const Tensor& dweights, bool averaged, int64_t N, int64_t H, int64_t L, int64_t S,
                              DType dtype);

// Head gates: heads (N, L, D) contiguous, D = H·Dh, in place: head h's
// columns times gate[h] (gate (H,) float32 or float64).
void gate_heads(Tensor& heads, const Tensor& gate);
// Their backward: dheads the gradient of the gated heads, ungated the heads
// before the gates; adds Σ dheads∘ungated over head h's columns into
// gate_grad[h], then multiplies dheads's columns by the gates (in place).
void gate_heads_backward(Tensor& dheads, const Tensor& ungated, const Tensor& gate, Tensor& gate_grad);

}  // namespace mha::nn
