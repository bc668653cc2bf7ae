// Axial attention (Ho et al., "Axial Attention in Multidimensional
// Transformers", 2019) over 2-D inputs (…, rows, cols, E): attention along
// each row, then along each column, the second pass reading the first's output
// as its values:
//
//   y[r, c] = Σ_c' softmax_c'(scale · q[r, c]·k[r, c']) v[r, c']        (along the row r)
//   out[r, c] = Σ_r' softmax_r'(scale · q[r, c]·k[r', c]) y[r', c]      (along the column c)
//
// so every output sees the whole image in two hops: out[r, c] mixes every
// v[r', c'] through the row of r' and the column of c. Each pass is exact
// softmax attention (attention_forward on strided views: the fused path for
// float32, the reference one for float64; no copies of q, k or v): cost
// O(rows·cols·(rows + cols)·E) instead of O((rows·cols)²·E); for a square
// n × n image of L = n² positions that is O(L^1.5·E), with O(L) extra memory.
//
// Backward runs the passes backwards: the column pass gives dq, dk and the
// gradient of y; the row pass takes that as its dout and gives dq, dk, dv;
// dq and dk are the sums of the two passes' contributions.
#pragma once

#include <optional>

#include "mha/attention.h"
#include "mha/tensor.h"

namespace mha {

struct AxialOptions {
  std::optional<double> scale;                    // default 1/sqrt(E); must be finite
  AttentionPath path = AttentionPath::automatic;  // of both passes
};

struct AxialOutput {
  Tensor out;              // (…, rows, cols, Ev), contiguous, the inputs' dtype
  AttentionOutput row;     // the row pass: out = y (…, rows, cols, Ev), lse (…, rows, cols)
  AttentionOutput column;  // the column pass, in column order: out (…, cols, rows, Ev), lse (…, cols, rows)
};

// query, key (…, rows, cols, E), value (…, rows, cols, Ev): float32 or
// float64, one dtype, the same leading dims. Saved for backward: row and column.
AxialOutput axial_attention_forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                    const AxialOptions& options = {});

// dout shaped like out. Returns dquery, dkey, dvalue (contiguous).
AttentionGradients axial_attention_backward(const Tensor& dout, const Tensor& query, const Tensor& key,
                                            const Tensor& value, const AxialOutput& forward,
                                            const AxialOptions& options = {});

}  // namespace mha
