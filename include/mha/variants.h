// Efficient attention for long sequences and images: each variant a
// *_forward / *_backward pair on (…, L, E) tensors (float32, float64), with
// its derivation and cost in its header.
//
//   block_sparse.h      strided (Sparse Transformer) and BigBird layouts, exact within the pattern
//   linear_attention.h  φ(x) = elu(x) + 1, non-causal and causal (running sums)
//   performer.h         FAVOR+: positive orthogonal random features
//   linformer.h         learned sequence projections of keys and values, S → k
//   lsh.h               Reformer: shared-QK LSH buckets, chunked attention, several rounds
//   axial.h             2-D inputs: attention along rows, then along columns
//
// Local (sliding-window) attention is attention_forward's window_left/right.
#pragma once

#include "mha/variants/axial.h"
#include "mha/variants/block_sparse.h"
#include "mha/variants/linear_attention.h"
#include "mha/variants/linformer.h"
#include "mha/variants/lsh.h"
#include "mha/variants/performer.h"
