// Sinusoidal position encoding, as the seeds and "Attention Is All You Need"
// define it:
//   PE(pos, 2i)   = sin(pos / 10000^(2i/D))
//   PE(pos, 2i+1) = cos(pos / 10000^(2i/D))
// It has no parameters, so it works at any length, including lengths longer
// than those seen in training.
#pragma once

#include "mha/tensor.h"

namespace mha::nn {

// (L, D) table starting at position `offset` (for decoding step by step).
Tensor sinusoidal_encoding(int64_t L, int64_t D, DType dtype = DType::float32, int64_t offset = 0);

// x + PE over the sequence dim: x (L, N, D), or (N, L, D) when batch_first, or (L, D).
// The gradient with respect to x is dy itself.
Tensor add_sinusoidal_encoding(const Tensor& x, bool batch_first = false, int64_t offset = 0);

}  // namespace mha::nn
