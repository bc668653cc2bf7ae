// Layer stacks: the layers in order forward and in reverse backward, one
// position bias per forward shared by every layer, and decoding with a KV
// cache per layer (plus, in the decoder, cross-attention keys and values
// projected once).
#include "mha/nn/transformer_stack.h"

#include "nn/layer_util.h"

namespace mha::nn {

namespace {

// T5's buckets need an exact and a logarithmic bucket (per direction when bidirectional).
void check_stack_config(const TransformerStackConfig& c, bool bidirectional, const char* fn) {
  if (c.num_layers <= 0) raise<ValueError>(fn, "num_layers", "> 0", std::to_string(c.num_layers));
  if (c.position != Position::relative) return;
  const int64_t least = bidirectional ? 4 : 2;
  if (c.num_buckets < least)
    raise<ValueError>(fn, "num_buckets", ">= " + std::to_string(least) + " (relative positions)",
                      std::to_string(c.num_buckets));
  const int64_t exact = (bidirectional ? c.num_buckets / 2 : c.num_buckets) / 2;
  if (c.max_distance <= exact)
    raise<ValueError>(fn, "max_distance", "> " + std::to_string(exact) + " (relative positions)",
                      std::to_string(c.max_distance));
}

TransformerStackConfig checked(TransformerStackConfig c, bool bidirectional, const char* fn) {
  check_stack_config(c, bidirectional, fn);
  c.layer.batch_first = true;
  return c;
}

void check_sequences(const Tensor& x, const char* fn, const char* name) {
  check_defined(x, fn, name);
  if (x.dim() != 3) raise<ShapeError>(fn, name, "(B, L, D)", shape_string(x.shape()));
}

Tensor add_or_first(const Tensor& sum, const Tensor& term) { return sum.defined() ? add(sum, term) : term; }

}  // namespace

template <class Layer>
TransformerStack<Layer>::TransformerStack(const TransformerStackConfig& config, bool bidirectional, Generator& gen)
    : norm({.normalized_shape = config.layer.d_model, .eps = config.layer.layer_norm_eps, .dtype = config.layer.dtype}),
      config_(config),
      bidirectional_(bidirectional) {
  for (int64_t i = 0; i < config_.num_layers; ++i) layers.push_back(std::make_unique<Layer>(config_.layer, gen));
  if (config_.position == Position::relative)
    relative_attention_bias.emplace(
        EmbeddingConfig{.num_embeddings = config_.num_buckets, .embedding_dim = config_.layer.nhead,
                        .dtype = config_.layer.dtype},
        gen);
}

template <class Layer>
std::vector<NamedParameter> TransformerStack<Layer>::named_parameters() {
  std::vector<NamedParameter> out;
  for (size_t i = 0; i < layers.size(); ++i) append_parameters(out, "layers." + std::to_string(i), *layers[i]);
  if (relative_attention_bias) append_parameters(out, "relative_attention_bias", *relative_attention_bias);
  if (config_.layer.norm_first) append_parameters(out, "norm", norm);
  return out;
}

template <class Layer>
std::vector<NamedGenerator> TransformerStack<Layer>::named_generators() {
  std::vector<NamedGenerator> out;
  for (size_t i = 0; i < layers.size(); ++i) append_generators(out, "layers." + std::to_string(i), *layers[i]);
  return out;
}

template <class Layer>
void TransformerStack<Layer>::train(bool on) {
  Module::train(on);
  for (auto& layer : layers) layer->train(on);
}

template <class Layer>
void TransformerStack<Layer>::release_activations() {
  for (auto& layer : layers) layer->release_activations();
  if (relative_attention_bias) relative_attention_bias->release_activations();
  norm.release_activations();
}

template <class Layer>
Tensor TransformerStack<Layer>::position_bias(int64_t L, int64_t offset) {
  const int64_t S = offset + L, H = config_.layer.nhead;
  if (config_.position == Position::alibi) return alibi_bias(H, L, S, offset, config_.layer.dtype);
  if (config_.position != Position::relative) return {};
  // T5: the table's rows, (L, S, H), as per-head planes (1, H, L, S).
  const Tensor buckets =
      relative_position_buckets(L, S, offset, bidirectional_, config_.num_buckets, config_.max_distance);
  return relative_attention_bias->forward(buckets).permute({2, 0, 1}).unsqueeze(0).contiguous();
}

template <class Layer>
void TransformerStack<Layer>::position_bias_backward() {
  if (!relative_attention_bias) return;
  Tensor dbias;  // (1, H, L, L): the shared bias collects every layer's gradient
  for (size_t i = layers.size(); i-- > 0;) dbias = add_or_first(dbias, layers[i]->attn_bias_grad());
  relative_attention_bias->backward(dbias.select(0, 0).permute({1, 2, 0}));
}

template <class Layer>
void TransformerStack<Layer>::check_decode_batch(const Tensor& x, const char* fn) const {
  check_sequences(x, fn, "x");
  if (decoded_length() > 0 && x.size(0) != caches_[0].key.size(0))
    raise<ShapeError>(fn, "x", "batch size " + std::to_string(caches_[0].key.size(0)) + " (the sequence's so far)",
                      shape_string(x.shape()));
}

template class TransformerStack<TransformerEncoderLayer>;
template class TransformerStack<TransformerDecoderLayer>;

TransformerEncoder::TransformerEncoder(const TransformerStackConfig& config, bool causal, Generator& gen)
    : TransformerStack(checked(config, !causal, "mha::nn::TransformerEncoder"), !causal, gen) {}

Tensor TransformerEncoder::forward(const Tensor& x_in, const Tensor& key_padding_mask, bool need_weights) {
  check_sequences(x_in, "mha::nn::TransformerEncoder::forward", "x");
  const Tensor bias = position_bias(x_in.size(1), 0);
  weights_.clear();
  Tensor x = x_in;
  for (auto& layer : layers) {
    x = layer->forward(x, {.src_key_padding_mask = key_padding_mask, .is_causal = causal(),
                           .need_weights = need_weights, .attn_bias = bias, .attn_bias_grad = bias_has_grad()});
    if (need_weights) weights_.push_back(layer->last_attention_weights());
  }
  return final_norm(x);
}

Tensor TransformerEncoder::backward(const Tensor& dy) {
  Tensor g = final_norm_backward(dy);
  for (size_t i = layers.size(); i-- > 0;) g = layers[i]->backward(g);
  position_bias_backward();
  return g;
}

Tensor TransformerEncoder::decode_step(const Tensor& x_in) {
  const char* fn = "mha::nn::TransformerEncoder::decode_step";
  if (!causal()) raise<ValueError>(fn, "stack", "a causal encoder (decoding goes left to right)", "a bidirectional one");
  if (caches_.empty()) begin_decode();
  check_decode_batch(x_in, fn);
  const Tensor bias = position_bias(x_in.size(1), decoded_length());
  Tensor x = x_in;
  for (size_t i = 0; i < layers.size(); ++i)
    x = layers[i]->forward_cached(x, caches_[i], {.is_causal = true, .attn_bias = bias});
  return final_norm(x);
}

TransformerDecoder::TransformerDecoder(const TransformerStackConfig& config, Generator& gen)
    : TransformerStack(checked(config, false, "mha::nn::TransformerDecoder"), false, gen) {}

Tensor TransformerDecoder::forward(const Tensor& tgt, const Tensor& memory, const Tensor& memory_key_padding_mask,
                                   bool need_weights) {
  const char* fn = "mha::nn::TransformerDecoder::forward";
  check_sequences(tgt, fn, "tgt");
  check_sequences(memory, fn, "memory");
  const Tensor bias = position_bias(tgt.size(1), 0);
  weights_.clear();
  cross_weights_.clear();
  Tensor x = tgt;
  for (auto& layer : layers) {
    x = layer->forward(x, memory,
                       {.memory_key_padding_mask = memory_key_padding_mask, .tgt_is_causal = true,
                        .need_weights = need_weights, .tgt_attn_bias = bias, .tgt_attn_bias_grad = bias_has_grad()});
    if (need_weights) {
      weights_.push_back(layer->last_attention_weights());
      cross_weights_.push_back(layer->last_cross_attention_weights());
    }
  }
  return final_norm(x);
}

DecoderGradients TransformerDecoder::backward(const Tensor& dy) {
  DecoderGradients out{final_norm_backward(dy), Tensor()};
  for (size_t i = layers.size(); i-- > 0;) {
    const DecoderGradients layer = layers[i]->backward(out.dtgt);
    out.dtgt = layer.dtgt;
    out.dmemory = add_or_first(out.dmemory, layer.dmemory);
  }
  position_bias_backward();
  return out;
}

void TransformerDecoder::begin_decode(const Tensor& memory, const Tensor& memory_key_padding_mask) {
  check_sequences(memory, "mha::nn::TransformerDecoder::begin_decode", "memory");
  caches_.assign(layers.size(), KVCache{});
  memories_.clear();
  for (auto& layer : layers) memories_.push_back(layer->multihead_attn.project_memory(memory, memory));
  memory_key_padding_mask_ = memory_key_padding_mask;
}

Tensor TransformerDecoder::decode_step(const Tensor& tgt) {
  const char* fn = "mha::nn::TransformerDecoder::decode_step";
  if (memories_.empty()) throw StateError(std::string("[") + fn + "] state: expected begin_decode(memory) first; got none");
  check_decode_batch(tgt, fn);
  const Tensor bias = position_bias(tgt.size(1), decoded_length());
  Tensor x = tgt;
  for (size_t i = 0; i < layers.size(); ++i)
    x = layers[i]->forward_cached(
        x, caches_[i], memories_[i],
        {.memory_key_padding_mask = memory_key_padding_mask_, .tgt_is_causal = true, .tgt_attn_bias = bias});
  return final_norm(x);
}

}  // namespace mha::nn
