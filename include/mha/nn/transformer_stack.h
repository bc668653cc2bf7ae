// Stacks of Transformer layers over batch-first sequences (B, L, D), with the
// final LayerNorm of Pre-LN models and the positions that act inside
// self-attention, as torch.nn.TransformerEncoder and TransformerDecoder
// (parameter names layers.N.*, [relative_attention_bias.weight], [norm.*]):
//
//   TransformerEncoder  self-attention blocks: causal (the decoder-only
//                       LanguageModel) or bidirectional under a key padding
//                       mask (the encoder of EncoderDecoderModel)
//   TransformerDecoder  causal self-attention, then cross-attention to the
//                       encoder output (memory) under the memory's padding mask
//
// Positions (positional.h): relative adds T5's bias from one (num_buckets, H)
// table per stack shared by its layers, with bidirectional buckets in a
// bidirectional encoder and causal ones otherwise (as T5's encoder and
// decoder); alibi adds −m_h·|i − j|; rope rotates q and k of self-attention
// (layer.rotary_base). Cross-attention gets no position information.
// sinusoidal and learned positions are added to the embeddings, by the models.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "mha/nn/embedding.h"
#include "mha/nn/positional.h"
#include "mha/nn/transformer.h"

namespace mha::nn {

struct TransformerStackConfig {
  TransformerEncoderLayerConfig layer;  // every layer's; batch_first is set
  int64_t num_layers = 1;
  Position position = Position::sinusoidal;  // relative and alibi act here
  int64_t num_buckets = 32;                  // relative
  int64_t max_distance = 128;                // relative
  // The heads each layer keeps, by id (0 … layer.nhead − 1, ascending):
  // heads[i] for layer i's self-attention, cross_heads[i] for a decoder
  // layer's cross-attention; empty = every layer has all nhead. A head keeps
  // its id when others are pruned: head h's plane of the position bias
  // (relative, alibi) stays head h's. Every head is d_model / nhead wide.
  std::vector<std::vector<int64_t>> heads, cross_heads;
};

// 0 … n − 1.
std::vector<int64_t> all_heads(int64_t n);
// t's planes along dim (one per head, the heads `ids`) placed by id into
// nhead planes, the missing heads' planes `fill`; t itself when it has all nhead.
Tensor heads_by_id(const Tensor& t, int64_t dim, const std::vector<int64_t>& ids, int64_t nhead, double fill);
// Per-layer head lists as TransformerStackConfig::heads describes them (or none).
void check_head_lists(const std::vector<std::vector<int64_t>>& lists, int64_t num_layers, int64_t nhead,
                      const char* name, const char* fn);
// Prunes heads, by id, from one layer's attention and from its list (the
// lists made explicit first when empty). Refuses ids the layer lacks.
void prune_layer_heads(std::vector<std::vector<int64_t>>& lists, int64_t num_layers, int64_t nhead, int64_t layer,
                       const std::vector<int64_t>& ids, MultiheadAttention& attention, const char* fn);

// What both stacks share: the layers, the relative table and the final norm.
template <class Layer>
class TransformerStack : public Module {
 public:
  const TransformerStackConfig& config() const { return config_; }
  // layers.N.*, [relative_attention_bias.weight], [norm.* (Pre-LN)].
  std::vector<NamedParameter> named_parameters() override;
  std::vector<NamedGenerator> named_generators() override;  // layers.N.*
  void train(bool on = true) override;
  void release_activations() override;

  // Each layer's self-attention weights (B, H, L, L) from the last forward
  // with need_weights (empty otherwise).
  const std::vector<Tensor>& attention_weights() const { return weights_; }
  // The ids of layer i's self-attention heads (cross: a decoder layer's cross-attention's).
  std::vector<int64_t> head_ids(int64_t layer, bool cross = false) const;
  // Prunes heads (by id) from layer i's self- or cross-attention: the
  // layer's MultiheadAttention::prune_heads and this config's lists.
  void prune_heads(int64_t layer, const std::vector<int64_t>& ids, bool cross = false);

  // Positions decoded since begin_decode.
  int64_t decoded_length() const { return caches_.empty() ? 0 : caches_[0].length; }

  std::vector<std::unique_ptr<Layer>> layers;
  std::optional<Embedding> relative_attention_bias;  // relative: (num_buckets, H)
  LayerNorm norm;                                     // applied after the last layer when layer.norm_first

 protected:
  // Draws the layers' parameters, then the relative table's.
  TransformerStack(const TransformerStackConfig& config, bool bidirectional, Generator& gen);

  // (1, H, L, offset + L): relative or alibi bias of queries at positions
  // offset … offset + L − 1 against keys 0 … offset + L − 1; undefined for
  // the other position kinds.
  Tensor position_bias(int64_t L, int64_t offset);
  // Layer i's planes of that bias (its heads' ids).
  Tensor layer_bias(const Tensor& bias, size_t layer) const;
  bool bias_has_grad() const { return relative_attention_bias.has_value(); }
  // After the layers' backward: their bias gradients into the relative table.
  void position_bias_backward();
  Tensor final_norm(const Tensor& x) { return config_.layer.norm_first ? norm.forward(x) : x; }
  Tensor final_norm_backward(const Tensor& dy) { return config_.layer.norm_first ? norm.backward(dy) : dy; }
  // Decoding: x (B, L, D) continues the sequence of the caches (same batch).
  void check_decode_batch(const Tensor& x, const char* fn) const;

  TransformerStackConfig config_;
  bool bidirectional_;
  std::vector<Tensor> weights_;
  std::vector<KVCache> caches_;  // one per layer's self-attention, while decoding
};

class TransformerEncoder : public TransformerStack<TransformerEncoderLayer> {
 public:
  // causal: each position attends to itself and the positions before it;
  // otherwise to every position that key_padding_mask does not mark.
  TransformerEncoder(const TransformerStackConfig& config, bool causal, Generator& gen);

  bool causal() const { return !bidirectional_; }
  // x (B, L, D) → (B, L, D). key_padding_mask (B, L) bool, true = padding
  // (attended to by no query), or undefined.
  Tensor forward(const Tensor& x, const Tensor& key_padding_mask = {}, bool need_weights = false);
  // dweights: per layer, the gradient of attention_weights()[i] (or none).
  Tensor backward(const Tensor& dy, const std::vector<Tensor>& dweights = {});

  // Decoding with a KV cache per layer (causal stacks; inference): begin,
  // then decode_step(x (B, L_new, D)) for the next positions, equal to those
  // rows of forward() over the whole sequence. Overwrites what backward needs.
  void begin_decode() { caches_.assign(layers.size(), KVCache{}); }
  Tensor decode_step(const Tensor& x);
};

class TransformerDecoder : public TransformerStack<TransformerDecoderLayer> {
 public:
  TransformerDecoder(const TransformerStackConfig& config, Generator& gen);

  // tgt (B, T, D), memory (B, S, D) → (B, T, D); memory_key_padding_mask
  // (B, S) bool, true = padding, or undefined.
  Tensor forward(const Tensor& tgt, const Tensor& memory, const Tensor& memory_key_padding_mask = {},
                 bool need_weights = false);
  // dtgt, and dmemory summed over the layers.
  DecoderGradients backward(const Tensor& dy);
  // Each layer's cross-attention weights (B, H, T, S) from the last forward with need_weights.
  const std::vector<Tensor>& cross_attention_weights() const { return cross_weights_; }

  // Decoding (inference): begin_decode projects every layer's cross-attention
  // keys and values of `memory` once; decode_step(tgt (B, T_new, D)) runs
  // the next target positions against the self-attention caches and those
  // projections, equal to those rows of forward().
  void begin_decode(const Tensor& memory, const Tensor& memory_key_padding_mask = {});
  Tensor decode_step(const Tensor& tgt);

 private:
  std::vector<Tensor> cross_weights_;
  std::vector<KVCache> memories_;
  Tensor memory_key_padding_mask_;
};

extern template class TransformerStack<TransformerEncoderLayer>;
extern template class TransformerStack<TransformerDecoderLayer>;

}  // namespace mha::nn
