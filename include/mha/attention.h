// Scaled dot-product attention, forward and backward.
//
//   out = dropout(softmax(Q Kᵀ · scale + mask)) V
//
// Shapes (row-major, any strides):
//   query (…, Hq, L, E)   key (…, Hk, S, E)   value (…, Hv, S, Ev)
//   mask  broadcastable to (…, Hq, L, S)
// The leading dims ("batch dims", the heads dim included) broadcast against
// each other as in NumPy. The heads dim (the third from the end) also allows
// grouped-query attention: when Hk (= Hv) differs from Hq, is not 1, and
// divides Hq, query head h reads key/value head h / (Hq / Hk), without a copy
// of K or V. Multi-query attention is the case Hk = 1.
//
// Conventions (see docs/design.md):
//   * mask: boolean (true = may attend) or floating (added to the logits).
//   * causal: top_left keeps key j for query i when j <= i (PyTorch's
//     is_causal); bottom_right keeps j <= i + (S - L) (FlashAttention >= 2.1,
//     decoding with a KV cache). Combined with `mask` by "and".
//   * window (local attention, as FlashAttention's window_size): keeps
//     i + (S - L) - window_left <= j <= i + (S - L) + window_right; -1 leaves
//     that side unbounded. Combined with the mask and causal by "and".
//   * A fully masked row has output 0, weights 0, lse = -inf and gradient 0.
//   * NaN and infinity propagate, never masked away: a non-finite element of
//     q, k or v reaches exactly the outputs and gradients whose formula reads
//     it, on every path, as in PyTorch; keys the mask, causality or the
//     window exclude are never read. Only the mask empties a row: a row whose
//     allowed logits are all -inf from the data is NaN.
//   * dropout: element (b, i, j) is kept with probability 1 - p by a
//     counter-based generator keyed by dropout_seed, so backward regenerates
//     the same pattern without storing it. Kept weights are scaled by 1/(1-p).
//   * Returned weights are the ones that multiplied V (after dropout), as in
//     torch.nn.MultiheadAttention.
#pragma once

#include <optional>
#include <string>

#include "mha/tensor.h"

namespace mha {

enum class Causal : uint8_t { none, top_left, bottom_right };

// Which implementation runs. `automatic` picks by the rule in docs/design.md:
// fused for float32 and bfloat16 unless a mask gradient is requested;
// reference (plain loops, the ground truth) otherwise.
enum class AttentionPath : uint8_t { automatic, reference, fused };

std::string to_string(AttentionPath path);

struct AttentionOptions {
  Tensor mask;                  // undefined = no mask
  Causal causal = Causal::none;
  int64_t window_left = -1;     // -1 = unbounded
  int64_t window_right = -1;    // -1 = unbounded
  std::optional<double> scale;  // default 1/sqrt(E); must be finite
  double dropout_p = 0.0;       // in [0, 1)
  uint64_t dropout_seed = 0;
  bool return_weights = false;
  AttentionPath path = AttentionPath::automatic;
  // Memory the fused forward may spend, in bytes, to keep its scores (Q·Kᵀ,
  // finished with the scale and the mask, in float32 tiles) for the
  // backward, which then reads them instead of computing Q·Kᵀ again: one of
  // its five products, with the same sums and so the same gradients. 0 (the
  // default) keeps nothing, as FlashAttention: O(L) memory. Kept only by the
  // float32 kernels (not the bfloat16 products, nor decoding's few rows),
  // without a left window, and when all of them fit, in these bytes and under
  // set_memory_limit (else the call keeps none): about 4·batch·L·S bytes, half
  // that causal. mha::nn::MultiheadAttention sets it in training
  // (nn::score_memory_limit()).
  int64_t keep_scores_bytes = 0;
};

struct AttentionOutput {
  Tensor out;      // (batch…, L, Ev), query's dtype
  Tensor lse;      // (batch…, L): log Σ_j exp(logit_ij); float64 for float64 inputs, else float32
  Tensor weights;  // (batch…, L, S), query's dtype; defined only when requested
  Tensor scores;   // the kept scores (AttentionOptions::keep_scores_bytes), for the backward only: opaque
  AttentionPath path = AttentionPath::reference;  // the path that ran
};

// query, key, value: float32, float64 or bfloat16, all the same dtype.
// bfloat16 is computed in float32. Saved for backward: out and lse.
AttentionOutput attention_forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                  const AttentionOptions& options = {});

// attention_forward writing out into `out`: a tensor shaped (batch…, L, Ev)
// in the query's dtype and on its device, with unit stride along Ev, whose
// rows may lie apart, such as the (N, H, L, E) view of the heads of an
// (N, L, H·E) tensor (MultiheadAttention's heads, written in place). The
// result's `out` is `out` itself. It must not overlap the inputs.
AttentionOutput attention_forward_into(const Tensor& out, const Tensor& query, const Tensor& key,
                                       const Tensor& value, const AttentionOptions& options = {});

struct AttentionGradients {
  Tensor dquery, dkey, dvalue;  // shapes and dtypes of query, key, value
  Tensor dmask;                 // mask's shape; defined when requested for a floating mask
};

// dout: the gradient of out, shaped like out. `forward` is what
// attention_forward returned for the same inputs and options.
// mask_grad: also return the gradient of a floating (additive) mask.
// dweights: the gradient of forward.weights, when a loss used the returned
// weights too (attention supervision, attention transfer, entropy penalties):
// shaped (batch…, L, S) in the query's dtype, or undefined. With W = P ∘ C
// (C the dropout factors) it joins dout's: dP_ij = C_ij (dout_i·v_j + dW_ij),
// and the softmax's backward subtracts D_i = Σ_j P_ij dP_ij = dout_i·out_i +
// Σ_j W_ij dW_ij. Both paths run it; the fused one recomputes P from the lse
// and adds the weights' share with two products per chunk of queries (it then
// holds (chunk × S) floats per thread, like the weights themselves).
AttentionGradients attention_backward(const Tensor& dout, const Tensor& query, const Tensor& key,
                                      const Tensor& value, const AttentionOutput& forward,
                                      const AttentionOptions& options = {},
                                      bool mask_grad = false, const Tensor& dweights = {});

// attention_backward writing dQ, dK and dV into into.dquery, into.dkey and
// into.dvalue: tensors shaped, typed and placed as query, key and value, with
// unit last stride, their rows possibly apart (the q, k and v parts of one
// (N, L, 3·H·E) buffer, say), none overlapping another or the inputs. The
// mask's gradient, when asked for, is allocated into into.dmask.
void attention_backward_into(AttentionGradients& into, const Tensor& dout, const Tensor& query, const Tensor& key,
                             const Tensor& value, const AttentionOutput& forward, const AttentionOptions& options = {},
                             bool mask_grad = false, const Tensor& dweights = {});

}  // namespace mha
