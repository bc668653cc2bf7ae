// Embedding: a table lookup, as torch.nn.Embedding.
//   ids int64 (…) → (…, embedding_dim); weight (num_embeddings, embedding_dim),
//   initialised N(0, 1) with the padding row zero. Saved for backward: ids.
//   backward adds dy rows into weight_grad (the padding row gets none).
#pragma once

#include <optional>

#include "mha/nn/module.h"
#include "mha/random.h"

namespace mha::nn {

struct EmbeddingConfig {
  int64_t num_embeddings = 0;
  int64_t embedding_dim = 0;
  std::optional<int64_t> padding_idx;
  DType dtype = DType::float32;  // float32 or float64
};

class Embedding : public Module {
 public:
  Embedding(const EmbeddingConfig& config, Generator& gen);

  const EmbeddingConfig& config() const { return config_; }
  std::vector<NamedParameter> named_parameters() override { return {{"weight", &weight, &weight_grad}}; }

  Tensor forward(const Tensor& ids);
  void backward(const Tensor& dy);
  // The backward of a lookup of `ids`, whichever forward it was: for a table
  // looked up more than once before backward (an encoder–decoder's shared
  // embedding). dy: ids's shape + (embedding_dim).
  void backward(const Tensor& dy, const Tensor& ids);
  void release_activations() override { saved_ids_ = Tensor(); }

  Tensor weight, weight_grad;

 private:
  EmbeddingConfig config_;
  Tensor saved_ids_;
};

}  // namespace mha::nn
