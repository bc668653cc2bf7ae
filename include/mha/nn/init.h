// Weight initialisation schemes, applied to a built model's matrices.
//
// For a weight W of shape (fan_out, fan_in) (an embedding table counts as
// (num_embeddings, embedding_dim)):
//   xavier: U(-a, a), a = sqrt(6 / (fan_in + fan_out))   (Glorot & Bengio)
//   he:     N(0, 2 / fan_in)                              (He et al., for ReLU)
//   normal: N(0, std²), std = 0.02 by default             (GPT-2, BERT)
// Vectors (biases, LayerNorm gains and shifts) keep the values the layers
// gave them; `layer_default` leaves everything as constructed (torch's
// defaults, per layer).
#pragma once

#include <string>

#include "mha/nn/module.h"
#include "mha/random.h"

namespace mha::nn {

enum class Init { layer_default, xavier, he, normal };

Init parse_init(const std::string& name);  // "default", "xavier", "he", "normal"
std::string to_string(Init init);

// Re-initialises every parameter of 2 or more dims of `module` by `scheme`.
void initialize(Module& module, Init scheme, Generator& gen, double normal_std = 0.02);

}  // namespace mha::nn
