// Linformer (Wang et al., "Linformer: Self-Attention with Linear Complexity",
// 2020): keys and values are projected along the sequence, S → k, by learned
// matrices P_K and P_V (the paper's E and F, both k × S), and queries attend
// to the k projected rows:
//
//   K̄ = P_K K (k × E),  V̄ = P_V V (k × Ev),  out = softmax(scale · Q K̄ᵀ) V̄
//
// The softmax is exact over the k rows (it runs attention_forward on K̄, V̄:
// the fused path for float32, the reference one for float64), so the cost is
// O(S·k·(E + Ev)) for the projections plus O(L·k·(E + Ev)) for the attention,
// linear in the length for a fixed k, with O(k·(E + Ev)) extra memory per
// batch entry. The approximation rests on softmax(Q Kᵀ) being close to low
// rank; the error against exact attention falls as k grows on inputs that are
// (tests/test_linformer.cpp), and with k = S and identity projections it is exact.
//
// Backward: attention_backward gives dQ, dK̄, dV̄; then, per batch entry,
//   dK = P_Kᵀ dK̄,   dP_K = Σ_batch dK̄ Kᵀ   (and likewise dV, dP_V)
// One projection pair serves every batch entry and head (the paper's
// "headwise"/"layerwise" sharing); its gradient sums over them. There is no
// causal form: a row of K̄ mixes every position.
#pragma once

#include <cstdint>
#include <optional>

#include "mha/attention.h"
#include "mha/tensor.h"

namespace mha {

// A projection (k, length) with N(0, 1/k) entries from `seed`: the
// Johnson-Lindenstrauss scaling the paper's analysis uses; a starting point
// for the learned matrices.
Tensor linformer_projection(int64_t k, int64_t length, uint64_t seed, DType dtype = DType::float32);

struct LinformerOptions {
  Tensor key_projection;        // P_K (k, S), the inputs' dtype
  Tensor value_projection;      // P_V (k, S), the inputs' dtype
  std::optional<double> scale;  // default 1/sqrt(E); must be finite
  AttentionPath path = AttentionPath::automatic;  // of the attention over the projected rows
};

struct LinformerOutput {
  Tensor out;              // (…, L, Ev), the inputs' dtype
  Tensor lse;              // (…, L): log-sum-exp over the k projected keys
  Tensor projected_key;    // K̄ (…, k, E)
  Tensor projected_value;  // V̄ (…, k, Ev)
};

struct LinformerGradients {
  Tensor dquery, dkey, dvalue;                // the inputs' shapes (contiguous)
  Tensor dkey_projection, dvalue_projection;  // (k, S), summed over the batch entries
};

// query (…, L, E), key (…, S, E), value (…, S, Ev): float32 or float64, one
// dtype, the same leading dims. Saved for backward: everything in the output.
LinformerOutput linformer_attention_forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                            const LinformerOptions& options);

// dout shaped like out; the same options.
LinformerGradients linformer_attention_backward(const Tensor& dout, const Tensor& query, const Tensor& key,
                                                const Tensor& value, const LinformerOutput& forward,
                                                const LinformerOptions& options);

}  // namespace mha
