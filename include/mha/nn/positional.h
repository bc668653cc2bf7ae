// Position information for attention models, five ways:
//
//   sinusoidal  "Attention Is All You Need": added to the token embeddings,
//                 PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(…)
//   learned     a learned absolute table (max_len, D) added to the embeddings
//               (an Embedding looked up with position ids)
//   relative    T5's learned relative position bias: one scalar per head and
//               log-spaced bucket of the distance key − query, added to the
//               attention logits (Raffel et al. 2020)
//   rope        rotary position embedding: q and k of every head rotated by
//               angles proportional to their positions (Su et al. 2021)
//   alibi       a fixed per-head linear penalty −m_h · |i − j| on the logits
//               (Press et al. 2022)
//
// Only `learned` has a longest position; the others work at any length.
#pragma once

#include <string>
#include <vector>

#include "mha/tensor.h"

namespace mha::nn {

enum class Position { sinusoidal, learned, relative, rope, alibi };

Position parse_position(const std::string& name);  // ValueError for an unknown name
std::string to_string(Position position);

// --- sinusoidal ---------------------------------------------------------

// (L, D) table starting at position `offset` (for decoding step by step).
Tensor sinusoidal_encoding(int64_t L, int64_t D, DType dtype = DType::float32, int64_t offset = 0);

// x + PE over the sequence dim: x (L, N, D), or (N, L, D) when batch_first, or (L, D).
// The gradient with respect to x is dy itself.
Tensor add_sinusoidal_encoding(const Tensor& x, bool batch_first = false, int64_t offset = 0);

// --- learned --------------------------------------------------------------

// (N, L) int64 ids offset … offset + L − 1 in every row: the rows of a learned
// position table for a batch of N sequences.
Tensor position_ids(int64_t N, int64_t L, int64_t offset = 0);

// --- relative (T5) --------------------------------------------------------

// T5's bucket of relative_position = key position − query position, as
// transformers' T5Attention._relative_position_bucket computes it:
//   bidirectional: half the buckets for keys after the query, half before;
//   causal: only keys at or before the query count (later ones: bucket 0).
//   Of the (remaining) n buckets, distances below n/2 get one bucket each; the
//   rest share n/2 buckets spaced logarithmically up to max_distance, beyond
//   which everything lands in the last bucket.
int64_t relative_position_bucket(int64_t relative_position, bool bidirectional = false, int64_t num_buckets = 32,
                                 int64_t max_distance = 128);

// (L, S) int64 buckets for queries at positions offset … offset + L − 1 and
// keys at positions 0 … S − 1. Looking them up in a (num_buckets, H) table
// gives the bias of every head.
Tensor relative_position_buckets(int64_t L, int64_t S, int64_t offset = 0, bool bidirectional = false,
                                 int64_t num_buckets = 32, int64_t max_distance = 128);

// --- rope -----------------------------------------------------------------

// In place, through the view x (…, R, E) (E even, last dim contiguous): row r
// is at position offset + r, and each pair (x_2i, x_2i+1) is rotated by the
// angle θ = position · base^(−2i/E). Then q_m · k_n depends only on m − n.
// inverse: rotates by −θ. The rotation is orthogonal, so the backward of a
// rotation is the inverse rotation of the gradient.
void rotate_positions_(Tensor x, int64_t offset = 0, double base = 10000.0, bool inverse = false);

// --- alibi ----------------------------------------------------------------

// The paper's slopes: for H a power of two, the geometric sequence
// m_h = 2^(−8h/H), h = 1 … H (H = 8: 1/2, 1/4, …, 1/256); otherwise the
// slopes of the nearest lower power of two P, then every other slope of 2P.
std::vector<double> alibi_slopes(int64_t H);

// (1, H, L, S) additive bias −m_h · |offset + i − j| for queries at positions
// offset + i and keys at positions j.
Tensor alibi_bias(int64_t H, int64_t L, int64_t S, int64_t offset = 0, DType dtype = DType::float32);

}  // namespace mha::nn
