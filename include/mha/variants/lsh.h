// Reformer's LSH attention (Kitaev et al., "Reformer: The Efficient
// Transformer", 2020): queries attend only to keys that hash to nearby buckets.
//
// Shared QK: the keys are the normalised queries, k_j = q_j / |q_j|, so a
// query and its key hash alike. Logits s_ij = scale · q_i·k_j.
//
// Hashing (angular LSH by random rotations): with R_r an E × (buckets/2)
// Gaussian matrix for round r (drawn from `seed`),
//   h_r(x) = argmax([x R_r, -x R_r])  ∈ [0, buckets)
// so nearby directions tend to share a bucket. Each round sorts the positions
// by (bucket, position), cuts the sorted order into chunks of `chunk`, and lets
// every query attend to the keys of its own chunk and of the chunk before it
// (the first chunk looks at the last), so a bucket split across a chunk border
// is still seen. Causal: only keys at positions j <= i. A token does not attend
// to itself unless no round gives it another key: then its output is its own
// value (weight 1, lse = s_ii).
//
// Rounds combine by their log-sum-exp: with V_r(i) the keys round r gives i,
//   lse_r(i) = log Σ_{j ∈ V_r(i)} exp(s_ij),   lse(i) = log Σ_r exp(lse_r(i))
//   out_i = Σ_r exp(lse_r(i) - lse(i)) · out_r(i) = Σ_r Σ_{j ∈ V_r(i)} exp(s_ij - lse(i)) v_j
// i.e. exact softmax attention over the multiset union of the rounds' keys (a
// key two rounds both find counts twice, as in the paper without its optional
// de-duplication). The forward keeps a running (max, sum, accumulator) per
// query across rounds, like an online softmax. With one bucket and one chunk
// covering the sequence it is full attention without the diagonal
// (tests/test_lsh.cpp); more rounds find more of each query's strong keys.
//
// Backward recomputes the hashes (they come from the seed) and, with
// P_ij = exp(s_ij - lse(i)) and D_i = dout_i·out_i, per chunk
//   dS_ij = P_ij (dout_i·v_j - D_i),  dq_i += scale Σ_j dS_ij k_j,
//   dk_j += scale Σ_i dS_ij q_i,      dv_j += Σ_i P_ij dout_i,
// then the keys' gradient flows to the queries through the normalisation:
//   dq_j += (dk_j - k_j (k_j·dk_j)) / |q_j|.
// The hashes are piecewise constant: no gradient flows through them.
//
// Cost per round: O(L·E·buckets) to hash, O(L + buckets) to sort, and
// O(L · 2·chunk · (E + Ev)) to attend: O(hashes · L · (chunk + buckets) · E) in
// all, linear in L for fixed chunk and buckets. Memory per batch entry: O(L)
// in forward (the running softmax state, the order); backward adds the keys'
// gradient, O(L·E), and the look-back gradients of one chunk in 16.
#pragma once

#include <cstdint>
#include <optional>

#include "mha/tensor.h"

namespace mha {

struct LshOptions {
  int64_t buckets = 8;          // 1, or an even number >= 2
  int64_t hashes = 1;           // rounds, >= 1
  int64_t chunk = 64;           // chunk length in the sorted order, >= 1
  uint64_t seed = 0;            // draws the rotations; backward must get the same
  bool causal = false;          // key j seen by query i only when j <= i
  std::optional<double> scale;  // default 1/sqrt(E); must be finite
};

struct LshOutput {
  Tensor out;  // (…, L, Ev), the inputs' dtype
  Tensor lse;  // (…, L): the log-sum-exp over every round's keys
};

struct LshGradients {
  Tensor dquery, dvalue;  // the inputs' shapes (contiguous)
};

// query (…, L, E) (the keys are its rows normalised), value (…, L, Ev):
// float32 or float64, one dtype, the same leading dims. Saved for backward: out, lse.
LshOutput lsh_attention_forward(const Tensor& query, const Tensor& value, const LshOptions& options = {});

// dout shaped like out; the same options (the same seed).
LshGradients lsh_attention_backward(const Tensor& dout, const Tensor& query, const Tensor& value,
                                    const LshOutput& forward, const LshOptions& options = {});

// The buckets each round gives each position: int64 (hashes, …, L), for
// inspection and tests. The same as the attention uses for these options.
Tensor lsh_buckets(const Tensor& query, const LshOptions& options = {});

}  // namespace mha
