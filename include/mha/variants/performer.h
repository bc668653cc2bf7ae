// Performer attention, FAVOR+ (Choromanski et al., "Rethinking Attention with
// Performers", 2021): softmax attention approximated by linear attention with
// positive orthogonal random features.
//
// With x = √scale · q and y = √scale · k, the softmax kernel is
//   exp(scale · q·k) = exp(x·y) = E_ω[ exp(ω·x - |x|²/2) · exp(ω·y - |y|²/2) ],  ω ~ N(0, I_E),
// so with m draws ω_1 … ω_m (the rows of W, m × E) the feature map
//   φ(x)_r = exp(ω_r·x - |x|²/2) / √m
// gives φ(x)·φ(y) ≈ exp(x·y), an unbiased estimate with positive terms (no
// cancellation when the kernel is small, unlike sin/cos features). Blocks of E
// rows are made exactly orthogonal (then scaled by chi-distributed norms so
// each row is still distributed as N(0, I)), which lowers the variance.
// Attention is then linear attention with φ (see linear_attention.h):
//   out_i = φ(x_i)ᵀ Σ_j φ(y_j) v_jᵀ / φ(x_i)ᵀ Σ_j φ(y_j),   O(L·m·(E + Ev)) time.
// The error against exact attention falls as 1/√m (tests/test_kernel_attention.cpp).
//
// Stabilisers: a factor common to one query's features, or to all keys'
// features, cancels between numerator and denominator. So each query row is
// computed as exp(ω_r·x - max_r' ω_r'·x) (the |x|²/2 term cancels too) and the
// keys as exp(ω_r·y - |y|²/2 - c) with c the largest exponent over all keys of
// the batch entry: the largest feature is 1 and nothing overflows. Their
// derivatives contribute nothing (the output does not depend on them), so
// backward treats them as constants:
//   dq_i = √scale · Σ_r (dφ_ir φ_ir) ω_r
//   dk_j = √scale · Σ_r (dφ_jr φ_jr) (ω_r - y_j)
// Memory: the two feature maps, O((L + S)·m) per batch entry, plus the linear
// attention state; causal form as in linear_attention.h, O(L).
#pragma once

#include <cstdint>
#include <optional>

#include "mha/variants/linear_attention.h"

namespace mha {

// The projection W (features × head_dim) drawn from `seed`: orthogonal blocks
// of head_dim rows with N(0, I)-distributed row norms (orthogonal = true), or
// plain N(0, 1) entries. Call again with a new seed to redraw the features
// (Performer redraws them during training).
Tensor performer_features(int64_t features, int64_t head_dim, uint64_t seed, DType dtype = DType::float32,
                          bool orthogonal = true);

struct PerformerOptions {
  Tensor features;              // (m, E) from performer_features, the inputs' dtype
  bool causal = false;          // key j seen by query i only when j <= i; needs L = S
  std::optional<double> scale;  // the softmax scale approximated; default 1/sqrt(E); must be finite
};

// query (…, L, E), key (…, S, E), value (…, S, Ev): float32 or float64, one
// dtype, the same leading dims. Saved for backward: out and normalizer.
LinearAttentionOutput performer_attention_forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                                  const PerformerOptions& options);

// dout shaped like out; the same options (the same features). Returns dquery,
// dkey, dvalue (contiguous). The features get no gradient (they are drawn, not learned).
AttentionGradients performer_attention_backward(const Tensor& dout, const Tensor& query, const Tensor& key,
                                                const Tensor& value, const LinearAttentionOutput& forward,
                                                const PerformerOptions& options);

}  // namespace mha
