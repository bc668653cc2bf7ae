// A decoder-only (GPT-style) Transformer language model, or with
// config.causal = false a bidirectional encoder with the same per-position head:
//   ids (B, L) int64 → embedding (+ absolute positions: sinusoidal or learned)
//   → transformer: num_layers × TransformerEncoderLayer with a causal mask
//     (relative, rope and alibi positions act inside self-attention), then
//     the final LayerNorm of Pre-LN models (transformer_stack.h)
//   → head: Linear(D → vocab) → logits (B, L, vocab)
// backward(dlogits) accumulates every parameter's gradient.
//
// Positions (positional.h): sinusoidal (the default) and learned are added to
// the embeddings; relative adds T5's causal bucketed bias, one table
// (num_buckets, H) shared by every layer as in T5; alibi adds fixed linear
// biases; rope rotates q and k in every layer. Only learned has a longest
// sequence, max_len.
#pragma once

#include <memory>
#include <optional>

#include "mha/nn/embedding.h"
#include "mha/nn/positional.h"
#include "mha/nn/transformer_stack.h"

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
  Position position = Position::sinusoidal;
  int64_t max_len = 512;       // learned: positions 0 … max_len − 1
  int64_t num_buckets = 32;    // relative: T5's defaults
  int64_t max_distance = 128;  // relative
  double rope_base = 10000.0;  // rope
  // bf16_mixed: every layer's products and the head's take bfloat16
  // operands (mha/nn/precision.h); embeddings, norms and logits stay float32.
  Precision precision = Precision::float32;
  // Every layer recomputes its forward in backward, keeping only its input
  // (TransformerEncoderLayerConfig::checkpoint_activations).
  bool checkpoint_activations = false;
  // Every layer's self-attention (attention_variant.h): full, window or an
  // efficient variant. Only full and window decode with a KV cache.
  AttentionVariant attention;
  // false: every position attends to every other (a bidirectional encoder
  // with a per-position head, as BERT; no KV-cache decoding).
  bool causal = true;
  // The heads each layer keeps, by id in [0, nhead) (a count per layer, or
  // what pruning left): TransformerStackConfig::heads. Empty = nhead each.
  std::vector<std::vector<int64_t>> heads;
};

class LanguageModel : public Module {
 public:
  LanguageModel(const LanguageModelConfig& config, Generator& gen);

  const LanguageModelConfig& config() const { return config_; }
  // embedding.weight, [position_embedding.weight], layers.N.*,
  // [relative_attention_bias.weight], norm.* (Pre-LN), head.weight, head.bias.
  std::vector<NamedParameter> named_parameters() override;
  std::vector<NamedGenerator> named_generators() override;  // layers.N.*
  void train(bool on = true) override;
  void release_activations() override;

  // need_weights: keep each layer's per-head attention weights, (B, H, L, L),
  // in attention_weights() (for pictures; costs O(L²) per head).
  Tensor forward(const Tensor& ids, bool need_weights = false);
  // dhidden: an extra gradient of last_hidden() (a loss on the hidden states,
  // as distillation's); dweights: per layer, the gradient of
  // attention_weights()[i] (a loss on the attention).
  void backward(const Tensor& dlogits, const Tensor& dhidden = {}, const std::vector<Tensor>& dweights = {});
  // What the head read in the last forward: the final hidden states (B, L, D).
  const Tensor& last_hidden() const { return hidden_; }
  const std::vector<Tensor>& attention_weights() const { return transformer.attention_weights(); }

  // Incremental decoding with a KV cache per layer (inference; run in eval
  // mode). begin_decode() forgets the sequence; decode_step(ids (B, L))
  // appends L tokens at positions decoded_length() … and returns their logits
  // (B, L, vocab), equal to those of forward() over the whole sequence. Each
  // token costs O(decoded_length()) attention work. decode_step overwrites
  // what backward needs: call forward again before a backward.
  void begin_decode() { transformer.begin_decode(); }
  Tensor decode_step(const Tensor& ids);
  int64_t decoded_length() const { return transformer.decoded_length(); }

  // Removes heads (by id) from layer i's self-attention; config().heads follows.
  void prune_heads(int64_t layer, const std::vector<int64_t>& ids);

  // Built (and initialised) in this order.
  Embedding embedding;
  Linear head;
  TransformerEncoder transformer;               // causal unless config.causal = false; layers, relative_attention_bias, norm
  std::optional<Embedding> position_embedding;  // learned: (max_len, D)

 private:
  LanguageModelConfig config_;
  Tensor ids_;     // the last forward's, for the embeddings' backward
  Tensor hidden_;  // the last forward's final hidden states
};

}  // namespace mha::nn
