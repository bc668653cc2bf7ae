// Block-sparse attention with fixed patterns: Sparse Transformer's strided
// pattern (Child et al., 2019) and BigBird's global + window + random blocks
// (Zaheer et al., 2020). Exact softmax attention restricted to a pattern.
//
// The sequence is cut into blocks of `block` positions (the last one may be
// shorter). A layout lists, for each query block, the key blocks it sees.
// Query i in block I attends key j in block J iff (I, J) is in the layout
// (and j <= i when causal):
//
//   s_ij = scale · q_i·k_j,   out_i = Σ_{j visible} softmax_j(s_ij) v_j
//
// which is attention_forward with the dense mask block_sparse_mask() returns.
// Forward walks each query block's key blocks with an online softmax (running
// max m, sum l, rescaled accumulator), as the fused kernel does, and saves the
// row log-sum-exp. Backward recomputes P = exp(s - lse) block by block:
//
//   D_i = dout_i·out_i,  dS_ij = P_ij (dout_i·v_j - D_i)
//   dq_i = scale Σ_j dS_ij k_j          (pass 1: over each query block's row of the layout)
//   dk_j = scale Σ_i dS_ij q_i,  dv_j = Σ_i P_ij dout_i
//                                       (pass 2: over each key block's column)
//
// Two passes keep every gradient row written by one work item (no atomics, the
// result does not depend on the thread count) at the price of recomputing
// the logits once more. A visited block pair costs 2·block²·(E + Ev) flops
// forward and 2·block²·(5E + 3Ev) backward; blocks outside the layout cost
// nothing, so the time is O(nonzero blocks · block² · E) = O(L · blocks per
// row · block · E) and the memory beyond inputs and outputs O(L) (the lse and
// D) plus O(block²) per thread.
//
//   strided  (stride ≈ √(L/block)):  O(L·√L·E)    the Sparse Transformer's choice
//   BigBird  (fixed g, w, r):        O(L·(2g + 2w + 1 + r)·block·E), linear in L
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "mha/attention.h"
#include "mha/tensor.h"

namespace mha {

// Which key blocks each query block sees, in compressed rows. Query block I
// holds rows [I·block, (I+1)·block) ∩ [0, L), key block J keys likewise.
struct BlockSparseLayout {
  int64_t block = 64;
  int64_t query_blocks = 0, key_blocks = 0;  // ceil(L / block), ceil(S / block)
  // The key blocks of query block I: key_block[row_begin[I] … row_begin[I+1]),
  // strictly ascending. row_begin has query_blocks + 1 entries.
  std::vector<int64_t> row_begin;
  std::vector<int64_t> key_block;

  int64_t nonzero_blocks() const { return int64_t(key_block.size()); }
};

// Sparse Transformer's strided pattern as blocks: query block I sees key
// block J when |I - J| < local_blocks (the local band, the diagonal included)
// or when |I - J| is a multiple of stride_blocks (every stride-th block, so
// that two hops reach any block). Causal: only J <= I.
struct StridedPattern {
  int64_t block = 64;
  int64_t local_blocks = 2;
  int64_t stride_blocks = 8;
};
BlockSparseLayout strided_layout(int64_t length, const StridedPattern& pattern, bool causal = false);

// BigBird: the first global_blocks blocks see every block and are seen by
// every block; each block sees window_blocks neighbours on each side; and each
// other query block sees random_blocks more key blocks, drawn without
// replacement from those not already in its row by Philox from `seed` (the
// same seed gives the same layout). Causal: only J <= I.
struct BigBirdPattern {
  int64_t block = 64;
  int64_t global_blocks = 1;
  int64_t window_blocks = 1;
  int64_t random_blocks = 2;
  uint64_t seed = 0;
};
BlockSparseLayout bigbird_layout(int64_t length, const BigBirdPattern& pattern, bool causal = false);

// The pattern as a dense boolean (L, S) mask, true = may attend, the causal
// rule included: attention_forward with this mask computes the same thing
// (for tests and inspection; O(L·S) memory).
Tensor block_sparse_mask(const BlockSparseLayout& layout, int64_t L, int64_t S, bool causal = false);

struct BlockSparseOptions {
  BlockSparseLayout layout;     // must fit L and S: query_blocks = ceil(L/block), key_blocks = ceil(S/block)
  bool causal = false;          // top-left: key j visible to query i only when j <= i
  std::optional<double> scale;  // default 1/sqrt(E); must be finite
};

struct BlockSparseOutput {
  Tensor out;  // (…, L, Ev), the inputs' dtype
  Tensor lse;  // (…, L): log Σ_j exp(s_ij) over visible keys; -inf for a row that sees none (its out is 0)
};

// query (…, L, E), key (…, S, E), value (…, S, Ev): float32 or float64, one
// dtype, the same leading dims (…; no broadcasting). Saved for backward: out, lse.
BlockSparseOutput block_sparse_attention_forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                                 const BlockSparseOptions& options);

// dout shaped like out. Returns dquery, dkey, dvalue (contiguous, the inputs' shapes).
AttentionGradients block_sparse_attention_backward(const Tensor& dout, const Tensor& query, const Tensor& key,
                                                   const Tensor& value, const BlockSparseOutput& forward,
                                                   const BlockSparseOptions& options);

}  // namespace mha
