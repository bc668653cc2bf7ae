// A decoder-only (GPT-style) Transformer language model:
//   ids (B, L) int64 → embedding + sinusoidal positions
//   → num_layers × TransformerEncoderLayer with a causal mask (batch_first)
//   → final LayerNorm (Pre-LN models) → head: Linear(D → vocab) → logits (B, L, vocab)
// backward(dlogits) accumulates every parameter's gradient.
#pragma once

#include <memory>

#include "mha/nn/embedding.h"
#include "mha/nn/transformer.h"

namespace mha::nn {

struct LanguageModelConfig {
  int64_t vocab_size = 0;
  int64_t d_model = 64;
  int64_t nhead = 4;
  int64_t num_layers = 2;
  int64_t dim_feedforward = 256;
  double dropout = 0.0;
  Activation activation = Activation::gelu;
  bool norm_first = true;
  DType dtype = DType::float32;
};

class LanguageModel : public Module {
 public:
  LanguageModel(const LanguageModelConfig& config, Generator& gen);

  const LanguageModelConfig& config() const { return config_; }
  // embedding.weight, layers.N.*, norm.* (Pre-LN), head.weight, head.bias.
  std::vector<NamedParameter> named_parameters() override;
  std::vector<NamedGenerator> named_generators() override;  // layers.N.*
  void train(bool on = true) override;

  // need_weights: keep each layer's per-head attention weights, (B, H, L, L),
  // in attention_weights() (for pictures; costs O(L²) per head).
  Tensor forward(const Tensor& ids, bool need_weights = false);
  void backward(const Tensor& dlogits);
  const std::vector<Tensor>& attention_weights() const { return weights_; }

  Embedding embedding;
  std::vector<std::unique_ptr<TransformerEncoderLayer>> layers;
  LayerNorm norm;
  Linear head;

 private:
  LanguageModelConfig config_;
  std::vector<Tensor> weights_;
};

}  // namespace mha::nn
