// An encoder–decoder Transformer ("Attention Is All You Need", Vaswani et
// al. 2017) for sequence-to-sequence tasks:
//   src_ids (B, S) → embedding (+ absolute positions) → encoder:
//     num_encoder_layers × TransformerEncoderLayer, bidirectional under the
//     source key padding mask, then the final LayerNorm of Pre-LN models
//     → memory (B, S, D)
//   tgt_ids (B, T) → embedding (+ absolute positions) → decoder:
//     num_layers × TransformerDecoderLayer (causal self-attention, then
//     cross-attention to memory under the same padding mask), then the final
//     LayerNorm of Pre-LN models → head: Linear(D → vocab) → logits (B, T, vocab)
// One token embedding serves source and target (one vocabulary; the paper
// shares it too), and so does the learned position table. The position kinds
// are the decoder-only model's: sinusoidal and learned are added to both
// embeddings; relative (a table per stack: bidirectional buckets in the
// encoder, causal in the decoder), alibi and rope act inside both
// self-attentions. Cross-attention has no position information.
// backward(dlogits) accumulates every parameter's gradient.
#pragma once

#include "mha/nn/language_model.h"

namespace mha::nn {

struct EncoderDecoderConfig {
  // The decoder's settings (its depth num_layers, the vocabulary, width,
  // heads, positions …), which the encoder shares but for its depth.
  LanguageModelConfig decoder;
  int64_t num_encoder_layers = 2;
  // The encoder's and the decoder's cross-attention heads per layer, by id
  // (TransformerStackConfig::heads); the decoder's self-attention heads are
  // decoder.heads. Empty = nhead each.
  std::vector<std::vector<int64_t>> encoder_heads, cross_heads;
};

// The attention sites of an encoder–decoder model.
enum class Site { encoder, decoder, cross };

class EncoderDecoderModel : public Module {
 public:
  EncoderDecoderModel(const EncoderDecoderConfig& config, Generator& gen);

  const EncoderDecoderConfig& config() const { return config_; }
  // embedding.weight, [position_embedding.weight], encoder.layers.N.*,
  // [encoder.relative_attention_bias.weight], [encoder.norm.*], decoder.layers.N.*
  // (self_attn, multihead_attn, …), [decoder.relative_attention_bias.weight],
  // [decoder.norm.*], head.weight, head.bias.
  std::vector<NamedParameter> named_parameters() override;
  std::vector<NamedGenerator> named_generators() override;  // encoder.layers.N.*, decoder.layers.N.*
  void train(bool on = true) override;
  void release_activations() override;

  // src_ids (B, S), tgt_ids (B, T) int64; src_key_padding_mask (B, S) bool,
  // true at padding (no query attends to it; but with an attention kind that
  // forms no weights, config.decoder.attention, the encoder's self-attention
  // reads padding as tokens and only cross-attention skips it), or undefined → logits (B, T,
  // vocab). need_weights: keep every attention's per-head weights, in
  // encoder.attention_weights() (B, H, S, S), decoder.attention_weights()
  // (B, H, T, T) and decoder.cross_attention_weights() (B, H, T, S).
  Tensor forward(const Tensor& src_ids, const Tensor& tgt_ids, const Tensor& src_key_padding_mask = {},
                 bool need_weights = false);
  void backward(const Tensor& dlogits);

  // Greedy decoding (inference; run in eval mode): begin_decode runs the
  // encoder once and projects the cross-attention keys and values of its
  // output in every decoder layer; decode_step(tgt_ids (B, T_new)) appends
  // target tokens at positions decoded_length() … and returns their logits
  // (B, T_new, vocab), equal to those of forward() over the whole target.
  // Overwrites what backward needs.
  void begin_decode(const Tensor& src_ids, const Tensor& src_key_padding_mask = {});
  Tensor decode_step(const Tensor& tgt_ids);
  int64_t decoded_length() const { return decoder.decoded_length(); }

  // Removes heads (by id) from layer i of one site; config() follows.
  void prune_heads(Site site, int64_t layer, const std::vector<int64_t>& ids);

  // Built (and initialised) in this order.
  Embedding embedding;
  Linear head;
  TransformerEncoder encoder;                   // bidirectional
  TransformerDecoder decoder;
  std::optional<Embedding> position_embedding;  // learned: (max_len, D), source and target

 private:
  EncoderDecoderConfig config_;
  Tensor src_ids_, tgt_ids_;  // the last forward's, for the shared embeddings' backward
  bool decoding_ = false;     // begin_decode was called

  Tensor encode(const Tensor& src_ids, const Tensor& src_key_padding_mask, bool need_weights, const char* fn);
};

}  // namespace mha::nn
