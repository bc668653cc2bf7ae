// The decoder-only model: a stack of causal encoder layers between an
// embedding and a linear head, with the position kind chosen in the config.
#include "mha/nn/language_model.h"

#include "nn/layer_util.h"

namespace mha::nn {

namespace {

constexpr const char* kCtor = "mha::nn::LanguageModel";

void check_config(const LanguageModelConfig& c) {
  if (c.num_layers <= 0) raise<ValueError>(kCtor, "num_layers", "> 0", std::to_string(c.num_layers));
  if (c.position == Position::learned && c.max_len <= 0)
    raise<ValueError>(kCtor, "max_len", "> 0 (learned positions)", std::to_string(c.max_len));
  if (c.position == Position::relative && c.num_buckets < 2)
    raise<ValueError>(kCtor, "num_buckets", ">= 2 (relative positions)", std::to_string(c.num_buckets));
  if (c.position == Position::relative && c.max_distance <= c.num_buckets / 2)
    raise<ValueError>(kCtor, "max_distance", "> num_buckets / 2 = " + std::to_string(c.num_buckets / 2) +
                      " (relative positions)", std::to_string(c.max_distance));
  if (c.position == Position::rope && c.nhead > 0 && (c.d_model % c.nhead != 0 || (c.d_model / c.nhead) % 2 != 0))
    raise<ValueError>(kCtor, "d_model", "an even multiple of nhead = " + std::to_string(c.nhead) +
                      " (rope rotates pairs of each head's dims)", std::to_string(c.d_model));
}

void check_ids(const Tensor& ids, const char* fn) {
  check_defined(ids, fn, "ids");
  if (ids.dim() != 2) raise<ShapeError>(fn, "ids", "(B, L)", shape_string(ids.shape()));
}

}  // namespace

LanguageModel::LanguageModel(const LanguageModelConfig& c, Generator& gen)
    : embedding({.num_embeddings = c.vocab_size, .embedding_dim = c.d_model, .dtype = c.dtype}, gen),
      norm({.normalized_shape = c.d_model, .dtype = c.dtype}),
      head({.in_features = c.d_model, .out_features = c.vocab_size, .dtype = c.dtype, .precision = c.precision}, gen),
      config_(c) {
  check_config(c);
  const std::optional<double> rotary = c.position == Position::rope ? std::optional(c.rope_base) : std::nullopt;
  for (int64_t i = 0; i < c.num_layers; ++i)
    layers.push_back(std::make_unique<TransformerEncoderLayer>(
        TransformerEncoderLayerConfig{.d_model = c.d_model, .nhead = c.nhead, .dim_feedforward = c.dim_feedforward,
                                      .dropout = c.dropout, .activation = c.activation, .batch_first = true,
                                      .norm_first = c.norm_first, .dtype = c.dtype, .rotary_base = rotary,
                                      .precision = c.precision},
        gen));
  // Drawn last, so that a sinusoidal model is initialised as before.
  if (c.position == Position::learned)
    position_embedding.emplace(EmbeddingConfig{.num_embeddings = c.max_len, .embedding_dim = c.d_model, .dtype = c.dtype},
                               gen);
  if (c.position == Position::relative)
    relative_attention_bias.emplace(
        EmbeddingConfig{.num_embeddings = c.num_buckets, .embedding_dim = c.nhead, .dtype = c.dtype}, gen);
}

std::vector<NamedParameter> LanguageModel::named_parameters() {
  std::vector<NamedParameter> out;
  append_parameters(out, "embedding", embedding);
  if (position_embedding) append_parameters(out, "position_embedding", *position_embedding);
  for (size_t i = 0; i < layers.size(); ++i) append_parameters(out, "layers." + std::to_string(i), *layers[i]);
  if (relative_attention_bias) append_parameters(out, "relative_attention_bias", *relative_attention_bias);
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
  head.train(on);
}

// Token embeddings plus absolute positions offset … offset + L − 1.
Tensor LanguageModel::embed(const Tensor& ids, int64_t offset, const char* fn) {
  const int64_t B = ids.size(0), L = ids.size(1);
  // Embeddings are N(0, 1) and sinusoids in [-1, 1]: comparable scales, so
  // they are summed as they are (no √D factor).
  Tensor x = embedding.forward(ids);
  if (config_.position == Position::sinusoidal) return add_sinusoidal_encoding(x, true, offset);
  if (config_.position != Position::learned) return x;
  if (offset + L > config_.max_len)
    raise<ValueError>(fn, "ids", "at most max_len = " + std::to_string(config_.max_len) +
                      " positions (learned position embedding)", "positions up to " + std::to_string(offset + L));
  return add(x, position_embedding->forward(position_ids(B, L, offset)));
}

// The (1, H, L, offset + L) bias of relative or alibi positions for queries
// at positions offset … offset + L − 1; undefined for the other kinds.
Tensor LanguageModel::attention_bias(int64_t L, int64_t offset) {
  const int64_t S = offset + L;
  if (config_.position == Position::alibi) return alibi_bias(config_.nhead, L, S, offset, config_.dtype);
  if (config_.position != Position::relative) return {};
  // T5: the table's rows, (L, S, H), as per-head planes (1, H, L, S).
  const Tensor buckets = relative_position_buckets(L, S, offset, false, config_.num_buckets, config_.max_distance);
  return relative_attention_bias->forward(buckets).permute({2, 0, 1}).unsqueeze(0).contiguous();
}

Tensor LanguageModel::logits(const Tensor& x) { return head.forward(config_.norm_first ? norm.forward(x) : x); }

Tensor LanguageModel::forward(const Tensor& ids, bool need_weights) {
  const char* fn = "mha::nn::LanguageModel::forward";
  check_ids(ids, fn);
  Tensor x = embed(ids, 0, fn);
  const Tensor bias = attention_bias(ids.size(1), 0);
  weights_.clear();
  for (auto& layer : layers) {
    x = layer->forward(x, {.is_causal = true, .need_weights = need_weights, .attn_bias = bias,
                           .attn_bias_grad = relative_attention_bias.has_value()});
    if (need_weights) weights_.push_back(layer->last_attention_weights());
  }
  return logits(x);
}

void LanguageModel::backward(const Tensor& dlogits) {
  Tensor g = head.backward(dlogits);
  if (config_.norm_first) g = norm.backward(g);
  Tensor dbias;  // (1, H, L, L): the shared relative bias collects every layer's gradient
  for (size_t i = layers.size(); i-- > 0;) {
    g = layers[i]->backward(g);
    if (relative_attention_bias) dbias = dbias.defined() ? add(dbias, layers[i]->attn_bias_grad()) : layers[i]->attn_bias_grad();
  }
  if (relative_attention_bias) relative_attention_bias->backward(dbias.select(0, 0).permute({1, 2, 0}));
  if (position_embedding) position_embedding->backward(g);
  embedding.backward(g);  // sinusoidal positions pass the gradient through
}

void LanguageModel::begin_decode() { caches_.assign(layers.size(), KVCache{}); }

Tensor LanguageModel::decode_step(const Tensor& ids) {
  const char* fn = "mha::nn::LanguageModel::decode_step";
  check_ids(ids, fn);
  if (caches_.empty()) begin_decode();
  const int64_t offset = decoded_length();
  if (offset > 0 && ids.size(0) != caches_[0].key.size(0))
    raise<ShapeError>(fn, "ids", "batch size " + std::to_string(caches_[0].key.size(0)) + " (the sequence's so far)",
                      shape_string(ids.shape()));
  Tensor x = embed(ids, offset, fn);
  const Tensor bias = attention_bias(ids.size(1), offset);
  for (size_t i = 0; i < layers.size(); ++i)
    x = layers[i]->forward_cached(x, caches_[i], {.is_causal = true, .attn_bias = bias});
  return logits(x);
}

}  // namespace mha::nn
