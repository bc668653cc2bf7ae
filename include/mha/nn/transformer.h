// Transformer layers with the semantics and parameter names of
// torch.nn.TransformerEncoderLayer and torch.nn.TransformerDecoderLayer.
//
// Post-LN (norm_first = false, the original Transformer):
//   x = norm1(x + dropout1(self_attn(x)))
//   x = norm2(x + dropout2(linear2(dropout(activation(linear1(x))))))
// Pre-LN (norm_first = true):
//   x = x + dropout1(self_attn(norm1(x)))
//   x = x + dropout2(linear2(dropout(activation(linear1(norm2(x))))))
// src (S, N, D), or (N, S, D) with batch_first, or unbatched (S, D).
//
// The decoder adds cross-attention to the encoder output (memory) between
// its masked self-attention and the feed-forward network, each block with its
// residual connection and norm (norm1, norm2, norm3; dropout1..3).
//
// Activation checkpointing (config.checkpoint_activations): forward keeps
// only its inputs and the states of the layer's dropout generators, and frees
// every intermediate; backward first runs the forward again from them (the
// same dropout draws, so bit-identical activations), then its own backward,
// and frees the intermediates again. A layer then holds one input between
// forward and backward instead of all its activations.
#pragma once

#include "mha/nn/activation.h"
#include "mha/nn/dropout.h"
#include "mha/nn/layer_norm.h"
#include "mha/nn/linear.h"
#include "mha/nn/multihead_attention.h"

namespace mha::nn {

enum class Activation { relu, gelu };

struct TransformerEncoderLayerConfig {
  int64_t d_model = 0;
  int64_t nhead = 1;
  int64_t dim_feedforward = 2048;
  double dropout = 0.1;
  Activation activation = Activation::relu;
  double layer_norm_eps = 1e-5;
  bool batch_first = false;
  bool norm_first = false;
  DType dtype = DType::float32;  // float32 or float64
  std::optional<double> rotary_base;  // RoPE in self-attention (MultiheadAttentionConfig::rotary_base)
  Precision precision = Precision::float32;  // of the attention blocks and linear1/linear2 (mha/nn/precision.h)
  bool checkpoint_activations = false;  // recompute the forward in backward (above)
  // Self-attention's kind (attention_variant.h); cross-attention stays full.
  // Variants without weights get no attention dropout (the other dropouts stay).
  AttentionVariant attention;
  // Fewer heads than nhead (pruned, or a count per layer): self-attention's
  // and, in a decoder layer, cross-attention's head counts, each head still
  // d_model / nhead wide; 0 = no heads (the block adds out_proj's bias).
  // -1 = nhead.
  int64_t self_heads = -1, cross_heads = -1;
};

// ReLU or GELU, chosen at construction.
class ActivationLayer : public Elementwise {
 public:
  // (forward and backward take an `out` dtype: see activation.h.)
  explicit ActivationLayer(Activation kind) : Elementwise(kind == Activation::relu ? Function::relu : Function::gelu) {}
};

// What a checkpointed layer keeps of its forward to run it again in backward.
template <class Inputs>
struct ForwardReplay {
  Tensor input, memory;  // memory: the decoder layer's
  Inputs inputs;
  bool training = false;
  std::vector<Generator> generators;  // their states before the forward
};

struct EncoderInputs {
  Tensor src_mask;              // attn_mask of self_attn: (S, S) or (N·H, S, S)
  Tensor src_key_padding_mask;  // (N, S) or (S)
  bool is_causal = false;
  bool need_weights = false;    // keep self-attention's per-head weights in last_attention_weights()
  Tensor attn_bias;             // self-attention's additive (1 or N, H, S, S) bias (MultiheadAttentionInputs)
  bool attn_bias_grad = false;  // backward keeps its gradient in attn_bias_grad()
};

class TransformerEncoderLayer : public Module {
 public:
  TransformerEncoderLayer(const TransformerEncoderLayerConfig& config, Generator& gen);

  const TransformerEncoderLayerConfig& config() const { return config_; }
  // self_attn.*, linear1.*, linear2.*, norm1.*, norm2.* (torch's order).
  std::vector<NamedParameter> named_parameters() override;
  std::vector<NamedGenerator> named_generators() override;
  void train(bool on = true) override;
  void release_activations() override;

  Tensor forward(const Tensor& src, const EncoderInputs& inputs = {});
  // dweights: the gradient of last_attention_weights() when a loss used them.
  Tensor backward(const Tensor& dy, const Tensor& dweights = {});
  // (N, H, S, S) weights of the last forward with need_weights (else undefined).
  const Tensor& last_attention_weights() const { return weights_; }
  // The last backward's gradient of inputs.attn_bias (when attn_bias_grad).
  const Tensor& attn_bias_grad() const { return attn_bias_grad_; }

  // Decoding (inference): src holds new tokens; self-attention runs
  // self_attn.forward_cached against `cache` (is_causal and attn_bias of
  // inputs apply; attn_bias is (1 or N, H, S_new, cache.length + S_new)).
  Tensor forward_cached(const Tensor& src, KVCache& cache, const EncoderInputs& inputs = {});

  MultiheadAttention self_attn;
  Linear linear1, linear2;
  LayerNorm norm1, norm2;
  Dropout dropout, dropout1, dropout2;

 private:
  TransformerEncoderLayerConfig config_;
  ActivationLayer activation_;
  bool forwarded_ = false;
  Tensor weights_, attn_bias_grad_;
  ForwardReplay<EncoderInputs> replay_;

  std::vector<Module*> children();
  Tensor forward_blocks(const Tensor& src, const EncoderInputs& inputs);
};

// The decoder layer takes the encoder's configuration (same fields).
using TransformerDecoderLayerConfig = TransformerEncoderLayerConfig;

struct DecoderInputs {
  Tensor tgt_mask;                 // self-attention attn_mask: (T, T) or (N·H, T, T)
  Tensor memory_mask;              // cross-attention attn_mask: (T, S) or (N·H, T, S)
  Tensor tgt_key_padding_mask;     // (N, T) or (T)
  Tensor memory_key_padding_mask;  // (N, S) or (S)
  bool tgt_is_causal = false;
  bool memory_is_causal = false;
  bool need_weights = false;       // keep both attentions' per-head weights
  Tensor tgt_attn_bias;            // self-attention's additive (1 or N, H, T, T) bias
  bool tgt_attn_bias_grad = false; // backward keeps its gradient in attn_bias_grad()
};

struct DecoderGradients {
  Tensor dtgt, dmemory;
};

class TransformerDecoderLayer : public Module {
 public:
  TransformerDecoderLayer(const TransformerDecoderLayerConfig& config, Generator& gen);

  const TransformerDecoderLayerConfig& config() const { return config_; }
  // self_attn.*, multihead_attn.*, linear1.*, linear2.*, norm1.*, norm2.*, norm3.* (torch's order).
  std::vector<NamedParameter> named_parameters() override;
  std::vector<NamedGenerator> named_generators() override;
  void train(bool on = true) override;
  void release_activations() override;

  // tgt (T, N, D), memory (S, N, D) (batch_first: (N, T, D), (N, S, D)).
  Tensor forward(const Tensor& tgt, const Tensor& memory, const DecoderInputs& inputs = {});
  DecoderGradients backward(const Tensor& dy);
  // (N, H, T, T) self-attention and (N, H, T, S) cross-attention weights of
  // the last forward with need_weights (else undefined).
  const Tensor& last_attention_weights() const { return weights_; }
  const Tensor& last_cross_attention_weights() const { return cross_weights_; }
  // The last backward's gradient of inputs.tgt_attn_bias (when tgt_attn_bias_grad).
  const Tensor& attn_bias_grad() const { return attn_bias_grad_; }

  // Decoding (inference): tgt holds new tokens. Self-attention runs
  // forward_cached against `cache` (tgt_is_causal and tgt_attn_bias apply,
  // the bias (1 or N, H, T_new, cache.length + T_new)); cross-attention runs
  // multihead_attn.forward_memory against `memory`, its project_memory of the
  // encoder output (memory_key_padding_mask and memory_mask apply).
  Tensor forward_cached(const Tensor& tgt, KVCache& cache, const KVCache& memory, const DecoderInputs& inputs = {});

  MultiheadAttention self_attn, multihead_attn;
  Linear linear1, linear2;
  LayerNorm norm1, norm2, norm3;
  Dropout dropout, dropout1, dropout2, dropout3;

 private:
  TransformerDecoderLayerConfig config_;
  ActivationLayer activation_;
  bool forwarded_ = false;
  Tensor weights_, cross_weights_, attn_bias_grad_;
  ForwardReplay<DecoderInputs> replay_;

  std::vector<Module*> children();
  Tensor forward_blocks(const Tensor& tgt, const Tensor& memory, const DecoderInputs& inputs);
};

// a + b, element-wise, same shape and dtype (the residual connections).
Tensor add(const Tensor& a, const Tensor& b);

}  // namespace mha::nn
