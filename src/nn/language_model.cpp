// The decoder-only model: a stack of causal encoder layers between an
// embedding and a linear head.
#include "mha/nn/language_model.h"

#include "mha/nn/positional.h"
#include "nn/layer_util.h"

namespace mha::nn {

LanguageModel::LanguageModel(const LanguageModelConfig& c, Generator& gen)
    : embedding({.num_embeddings = c.vocab_size, .embedding_dim = c.d_model, .dtype = c.dtype}, gen),
      norm({.normalized_shape = c.d_model, .dtype = c.dtype}),
      head({.in_features = c.d_model, .out_features = c.vocab_size, .dtype = c.dtype}, gen),
      config_(c) {
  if (c.num_layers <= 0) raise<ValueError>("mha::nn::LanguageModel", "num_layers", "> 0", std::to_string(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i)
    layers.push_back(std::make_unique<TransformerEncoderLayer>(
        TransformerEncoderLayerConfig{.d_model = c.d_model, .nhead = c.nhead, .dim_feedforward = c.dim_feedforward,
                                      .dropout = c.dropout, .activation = c.activation, .batch_first = true,
                                      .norm_first = c.norm_first, .dtype = c.dtype},
        gen));
}

std::vector<NamedParameter> LanguageModel::named_parameters() {
  std::vector<NamedParameter> out;
  append_parameters(out, "embedding", embedding);
  for (size_t i = 0; i < layers.size(); ++i) append_parameters(out, "layers." + std::to_string(i), *layers[i]);
  if (config_.norm_first) append_parameters(out, "norm", norm);
  append_parameters(out, "head", head);
  return out;
}

std::vector<NamedGenerator> LanguageModel::named_generators() {
  std::vector<NamedGenerator> out;
  for (size_t i = 0; i < layers.size(); ++i) append_generators(out, "layers." + std::to_string(i), *layers[i]);
  return out;
}

void LanguageModel::train(bool on) {
  Module::train(on);
  for (auto& l : layers) l->train(on);
}

Tensor LanguageModel::forward(const Tensor& ids, bool need_weights) {
  const char* fn = "mha::nn::LanguageModel::forward";
  check_defined(ids, fn, "ids");
  if (ids.dim() != 2) raise<ShapeError>(fn, "ids", "(B, L)", shape_string(ids.shape()));
  // Embeddings are N(0, 1) and positions in [-1, 1]: comparable scales, so
  // they are summed as they are (no √D factor).
  Tensor x = add_sinusoidal_encoding(embedding.forward(ids), true);
  weights_.clear();
  for (auto& layer : layers) {
    x = layer->forward(x, {.is_causal = true, .need_weights = need_weights});
    if (need_weights) weights_.push_back(layer->last_attention_weights());
  }
  if (config_.norm_first) x = norm.forward(x);
  return head.forward(x);
}

void LanguageModel::backward(const Tensor& dlogits) {
  Tensor g = head.backward(dlogits);
  if (config_.norm_first) g = norm.backward(g);
  for (size_t i = layers.size(); i-- > 0;) g = layers[i]->backward(g);
  embedding.backward(g);  // the position encoding passes the gradient through
}

}  // namespace mha::nn
