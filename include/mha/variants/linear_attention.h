// Linear attention (Katharopoulos et al., "Transformers are RNNs", 2020):
// softmax(q·k) replaced by a positive kernel φ(q)·φ(k) with the feature map
// φ(x) = elu(x) + 1, so that the sums over keys factor out of the queries.
//
//   out_i = Σ_j (φ(q_i)·φ(k_j)) v_j / Σ_j φ(q_i)·φ(k_j)
//         = φ(q_i)ᵀ U / φ(q_i)ᵀ z,     U = Σ_j φ(k_j) v_jᵀ (E × Ev),  z = Σ_j φ(k_j)
//
// (j over all keys; causal: over j <= i, U_i and z_i running sums). Computing
// U and z first costs O(S·E·Ev), then every query O(E·Ev): O(L·E·Ev) time
// and O(E·Ev) state instead of O(L·S·E). No scale: there is no softmax.
//
// Causal form, in chunks of C rows so that it runs as matrix products and in
// parallel: with U_c the sum over the chunks before chunk c,
//   num_c = tril(Φq_c Φk_cᵀ) V̂_c + Φq_c U_c,   V̂ = [V, 1] (the ones give z),
// the chunks split into one segment per thread, each segment starting from
// the sum of the segments before it. Memory O(L·(E + Ev)) for the feature
// maps plus O(threads·E·Ev) of state: O(L), never O(L·E·Ev) or O(L²).
//
// Backward (ĝ_i = [dout_i / den_i, -(dout_i·out_i) / den_i], den_i = φ(q_i)ᵀ z_i,
// the gradient of num_i = [φ(q_i)ᵀ U_i, den_i]):
//   dφ(q_i) = Û_i ĝ_i                                   (Û = [U, z], running in causal form)
//   dφ(k_j) = R_j v̂_j,  dv_j = R_jᵀ φ(k_j)[:Ev],  R_j = Σ_{i sees j} φ(q_i) ĝ_iᵀ
// (R_j a suffix sum in causal form: the same chunked sweep, run backwards),
// then dq = dφ(q) ∘ φ'(q) with φ'(x) = 1 for x > 0, e^x otherwise.
#pragma once

#include "mha/attention.h"
#include "mha/tensor.h"

namespace mha {

struct LinearAttentionOptions {
  bool causal = false;  // key j seen by query i only when j <= i; needs L = S
};

// The result of a feature-map attention (linear attention and Performer).
struct LinearAttentionOutput {
  Tensor out;         // (…, L, Ev), the inputs' dtype
  // (…, L): den_i = Σ_j φ(q_i)·φ(k_j). Set to 0, with out_i = 0 and zero
  // gradient, when it underflows: below √(smallest normal), ~1e-19 in float32.
  Tensor normalizer;
};

// query (…, L, E), key (…, S, E), value (…, S, Ev): float32 or float64, one
// dtype, the same leading dims. Saved for backward: out and normalizer.
LinearAttentionOutput linear_attention_forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                               const LinearAttentionOptions& options = {});

// dout shaped like out. Returns dquery, dkey, dvalue (contiguous).
AttentionGradients linear_attention_backward(const Tensor& dout, const Tensor& query, const Tensor& key,
                                             const Tensor& value, const LinearAttentionOutput& forward,
                                             const LinearAttentionOptions& options = {});

}  // namespace mha
