// Layer stacks: the layers in order forward and in reverse backward, one
// position bias per forward shared by every layer, and decoding with a KV
// cache per layer (plus, in the decoder, cross-attention keys and values
// projected once).
#include "mha/nn/transformer_stack.h"

#include <algorithm>

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
  check_head_lists(c.heads, c.num_layers, c.layer.nhead, "heads", fn);
  check_head_lists(c.cross_heads, c.num_layers, c.layer.nhead, "cross_heads", fn);
  c.layer.batch_first = true;
  return c;
}

// Layer i's config: its head counts from the lists.
TransformerEncoderLayerConfig layer_config(const TransformerStackConfig& c, size_t i) {
  TransformerEncoderLayerConfig layer = c.layer;
  if (!c.heads.empty()) layer.self_heads = int64_t(c.heads[i].size());
  if (!c.cross_heads.empty()) layer.cross_heads = int64_t(c.cross_heads[i].size());
  return layer;
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
  for (int64_t i = 0; i < config_.num_layers; ++i)
    layers.push_back(std::make_unique<Layer>(layer_config(config_, size_t(i)), gen));
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
Tensor TransformerStack<Layer>::layer_bias(const Tensor& bias, size_t layer) const {
  if (!bias.defined() || config_.heads.empty()) return bias;
  const std::vector<int64_t>& ids = config_.heads[layer];
  if (int64_t(ids.size()) == config_.layer.nhead) return bias;
  Shape shape = bias.shape();
  shape[1] = int64_t(ids.size());
  Tensor out = Tensor::empty(shape, bias.dtype());
  for (size_t j = 0; j < ids.size(); ++j) out.select(1, int64_t(j)).copy_(bias.select(1, ids[j]));
  return out;
}

template <class Layer>
void TransformerStack<Layer>::position_bias_backward() {
  if (!relative_attention_bias) return;
  // (1, H, L, L): the shared bias collects every layer's gradient, each
  // layer's planes onto its heads' ids.
  Tensor dbias;
  for (size_t i = layers.size(); i-- > 0;)
    dbias = add_or_first(dbias, heads_by_id(layers[i]->attn_bias_grad(), 1, head_ids(int64_t(i)), config_.layer.nhead, 0.0));
  relative_attention_bias->backward(dbias.select(0, 0).permute({1, 2, 0}));
}

template <class Layer>
std::vector<int64_t> TransformerStack<Layer>::head_ids(int64_t layer, bool cross) const {
  const std::vector<std::vector<int64_t>>& lists = cross ? config_.cross_heads : config_.heads;
  return lists.empty() ? all_heads(config_.layer.nhead) : lists[size_t(layer)];
}

template <class Layer>
void TransformerStack<Layer>::prune_heads(int64_t layer, const std::vector<int64_t>& ids, bool cross) {
  const char* fn = "mha::nn::TransformerStack::prune_heads";
  if (layer < 0 || layer >= int64_t(layers.size()))
    raise<ValueError>(fn, "layer", "in [0, " + std::to_string(layers.size()) + ")", std::to_string(layer));
  MultiheadAttention* attention = &layers[size_t(layer)]->self_attn;
  if constexpr (std::is_same_v<Layer, TransformerDecoderLayer>) {
    if (cross) attention = &layers[size_t(layer)]->multihead_attn;
  } else if (cross) {
    raise<ValueError>(fn, "cross", "false (an encoder stack has no cross-attention)", "true");
  }
  prune_layer_heads(cross ? config_.cross_heads : config_.heads, config_.num_layers, config_.layer.nhead, layer, ids,
                    *attention, fn);
}

template <class Layer>
void TransformerStack<Layer>::check_decode_batch(const Tensor& x, const char* fn) const {
  check_sequences(x, fn, "x");
  if (decoded_length() > 0 && x.size(0) != caches_[0].key.size(0))
    raise<ShapeError>(fn, "x", "batch size " + std::to_string(caches_[0].key.size(0)) + " (the sequence's so far)",
                      shape_string(x.shape()));
}

Tensor heads_by_id(const Tensor& t, int64_t dim, const std::vector<int64_t>& ids, int64_t nhead, double fill) {
  if (int64_t(ids.size()) == nhead) return t;
  Shape shape = t.shape();
  shape[size_t(dim)] = nhead;
  Tensor out = Tensor::full(shape, fill, t.dtype());
  for (size_t j = 0; j < ids.size(); ++j) out.select(dim, ids[j]).copy_(t.select(dim, int64_t(j)));
  return out;
}

std::vector<int64_t> all_heads(int64_t n) {
  std::vector<int64_t> ids(size_t(std::max<int64_t>(n, 0)));
  for (int64_t h = 0; h < n; ++h) ids[size_t(h)] = h;
  return ids;
}

void check_head_lists(const std::vector<std::vector<int64_t>>& lists, int64_t num_layers, int64_t nhead,
                      const char* name, const char* fn) {
  if (lists.empty()) return;
  if (int64_t(lists.size()) != num_layers)
    raise<ValueError>(fn, name, "one list of heads per layer (" + std::to_string(num_layers) + ")",
                      std::to_string(lists.size()) + " lists");
  for (const std::vector<int64_t>& ids : lists)
    for (size_t j = 0; j < ids.size(); ++j)
      if (ids[j] < 0 || ids[j] >= nhead || (j > 0 && ids[j] <= ids[j - 1]))
        raise<ValueError>(fn, name, "ascending head ids in [0, " + std::to_string(nhead) + ") (nhead)",
                          "id " + std::to_string(ids[j]));
}

void prune_layer_heads(std::vector<std::vector<int64_t>>& lists, int64_t num_layers, int64_t nhead, int64_t layer,
                       const std::vector<int64_t>& ids, MultiheadAttention& attention, const char* fn) {
  if (layer < 0 || layer >= num_layers)
    raise<ValueError>(fn, "layer", "in [0, " + std::to_string(num_layers) + ")", std::to_string(layer));
  const std::vector<int64_t> have = lists.empty() ? all_heads(nhead) : lists[size_t(layer)];
  std::vector<int64_t> positions;
  for (int64_t id : ids) {
    const auto at = std::find(have.begin(), have.end(), id);
    if (at == have.end())
      raise<ValueError>(fn, "ids", "heads of layer " + std::to_string(layer) + " (" + std::to_string(have.size()) +
                        " left)", "head " + std::to_string(id) + ", which it does not have");
    positions.push_back(int64_t(at - have.begin()));
  }
  attention.prune_heads(positions);
  if (lists.empty()) lists.assign(size_t(num_layers), all_heads(nhead));
  std::vector<int64_t>& kept = lists[size_t(layer)];
  kept.erase(std::remove_if(kept.begin(), kept.end(),
                            [&](int64_t id) { return std::find(ids.begin(), ids.end(), id) != ids.end(); }),
             kept.end());
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
  for (size_t i = 0; i < layers.size(); ++i) {
    x = layers[i]->forward(x, {.src_key_padding_mask = key_padding_mask, .is_causal = causal(),
                               .need_weights = need_weights, .attn_bias = layer_bias(bias, i),
                               .attn_bias_grad = bias_has_grad()});
    if (need_weights) weights_.push_back(layers[i]->last_attention_weights());
  }
  return final_norm(x);
}

Tensor TransformerEncoder::backward(const Tensor& dy, const std::vector<Tensor>& dweights) {
  if (!dweights.empty() && dweights.size() != layers.size())
    raise<ValueError>("mha::nn::TransformerEncoder::backward", "dweights",
                      "one tensor (or none) per layer (" + std::to_string(layers.size()) + ")",
                      std::to_string(dweights.size()));
  Tensor g = final_norm_backward(dy);
  if (config_.layer.norm_first) report_gradients_ready(norm);
  for (size_t i = layers.size(); i-- > 0;) {
    g = layers[i]->backward(g, dweights.empty() ? Tensor() : dweights[i]);
    report_gradients_ready(*layers[i]);
  }
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
    x = layers[i]->forward_cached(x, caches_[i], {.is_causal = true, .attn_bias = layer_bias(bias, i)});
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
  for (size_t i = 0; i < layers.size(); ++i) {
    x = layers[i]->forward(x, memory,
                           {.memory_key_padding_mask = memory_key_padding_mask, .tgt_is_causal = true,
                            .need_weights = need_weights, .tgt_attn_bias = layer_bias(bias, i),
                            .tgt_attn_bias_grad = bias_has_grad()});
    if (need_weights) {
      weights_.push_back(layers[i]->last_attention_weights());
      cross_weights_.push_back(layers[i]->last_cross_attention_weights());
    }
  }
  return final_norm(x);
}

DecoderGradients TransformerDecoder::backward(const Tensor& dy) {
  DecoderGradients out{final_norm_backward(dy), Tensor()};
  if (config_.layer.norm_first) report_gradients_ready(norm);
  for (size_t i = layers.size(); i-- > 0;) {
    const DecoderGradients layer = layers[i]->backward(out.dtgt);
    out.dtgt = layer.dtgt;
    out.dmemory = add_or_first(out.dmemory, layer.dmemory);
    report_gradients_ready(*layers[i]);
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
        {.memory_key_padding_mask = memory_key_padding_mask_, .tgt_is_causal = true,
         .tgt_attn_bias = layer_bias(bias, i)});
  return final_norm(x);
}

}  // namespace mha::nn
