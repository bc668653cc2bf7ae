// AttentionParams: a validated attention call, as the kernels see it.
//
// The output has batch entries b = 0 … batch-1 (row-major over batch_shape).
// For entry b, query rows start at q.data + q_offset[b] with row stride q_row
// and element stride q_col; likewise key, value and mask. Broadcast and
// grouped-query dims are folded into the offsets, so kernels never see them.
#pragma once

#include <cstdint>
#include <vector>

#include "mha/attention.h"

namespace mha {

struct AttentionParams {
  DType dtype = DType::float32;    // of query, key, value and the outputs
  DType compute = DType::float32;  // float64 for float64 inputs, else float32
  Shape batch_shape;
  int64_t batch = 1;
  int64_t L = 0, S = 0, E = 0, Ev = 0;

  Tensor q, k, v;  // as given (any strides)
  std::vector<int64_t> q_offset, k_offset, v_offset;
  int64_t q_row = 0, q_col = 0, k_row = 0, k_col = 0, v_row = 0, v_col = 0;

  // Additive mask in the compute dtype, contiguous, shaped like the user's
  // mask (bool masks become 0 / -inf). Undefined when there is no mask.
  Tensor mask;
  bool mask_from_bool = false;
  std::vector<int64_t> mask_offset;
  int64_t mask_row = 0, mask_col = 0;  // 0 where the mask broadcasts over L or S

  double scale = 1.0;
  Causal causal = Causal::none;
  // Causal and window rules as one band: key j is visible to query i iff
  // i + lo_shift <= j < i + hi_shift (and 0 <= j < S).
  int64_t lo_shift = 0, hi_shift = 0;
  double dropout_p = 0.0;
  uint64_t dropout_seed = 0;
  bool return_weights = false;
  int64_t keep_scores_bytes = 0;  // AttentionOptions'
  // Backward only: the gradient of the returned weights, contiguous (batch…,
  // L, S) in dtype; undefined when the loss did not use them.
  Tensor dweights;

  AttentionPath path = AttentionPath::reference;  // the path chosen to run

  // Keys that query row i may see by the band: key_begin(i) <= j < key_end(i).
  int64_t key_begin(int64_t i) const { return clamp(i + lo_shift); }
  int64_t key_end(int64_t i) const { return clamp(i + hi_shift); }
  int64_t clamp(int64_t j) const { return j < 0 ? 0 : (j > S ? S : j); }
};

// Offsets of each output batch entry into a tensor whose leading dims are
// `shape`/`strides` (right-aligned against batch_shape). A dim of size n
// against an output size N reads index i / (N / n): 0 when n = 1 (broadcast),
// i when n = N, and the grouped-query head when n divides N.
std::vector<int64_t> batch_offsets(const Shape& batch_shape, const Shape& shape, const Shape& strides);

}  // namespace mha
