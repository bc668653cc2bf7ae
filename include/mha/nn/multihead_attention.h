// Multi-head attention with the semantics and parameters of
// torch.nn.MultiheadAttention.
//
//   q = query Wqᵀ + bq,  k = key Wkᵀ + bk,  v = value Wvᵀ + bv
//   head_h = attention(q_h, k_h, v_h)          (h = 0 … num_heads-1)
//   output = concat(head_0 … head_{H-1}) Woᵀ + bo
//
// Each head has width hd = head_dim (embed_dim / num_heads unless set):
// the heads together are I = H·hd wide, Wq, Wk, Wv are (I, ·) and Wo is
// (D, I). Torch's module has I = D; pruning heads (prune_heads) or setting
// head_dim makes them differ, and a module may have no heads at all (H = 0:
// its output is bo, the same for every row).
//
// Shapes (D = embed_dim; N batch; L target and S source length):
//   query (L, N, D), key (S, N, kdim), value (S, N, vdim); (N, L, D) … when
//   batch_first; unbatched (L, D), (S, kdim), (S, vdim).
//   key_padding_mask (N, S) or (S): bool (true = ignore that key) or float (added).
//   attn_mask (L, S) or (N·H, L, S): bool (true = NOT allowed, as in torch) or float (added).
//   output like query; weights (N, L, S) averaged over heads, or (N, H, L, S).
//
// Extensions (unset, the module is torch's): RoPE on q and k (rotary_base),
// an additive per-head bias with its gradient (attn_bias), incremental
// self-attention against a KV cache (forward_cached), and cross-attention
// against keys and values projected once (project_memory, forward_memory),
// and the efficient attention variants (config.attention).
// Differences from torch are listed in docs/design.md.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mha/attention.h"
#include "mha/nn/attention_variant.h"
#include "mha/nn/module.h"
#include "mha/nn/precision.h"
#include "mha/random.h"
#include "mha/tensor.h"

namespace mha::nn {

struct MultiheadAttentionConfig {
  int64_t embed_dim = 0;
  int64_t num_heads = 1;  // 0: no heads (set head_dim)
  int64_t head_dim = 0;   // 0 = embed_dim / num_heads
  double dropout = 0.0;
  bool bias = true;
  bool add_bias_kv = false;
  bool add_zero_attn = false;
  int64_t kdim = 0;  // 0 = embed_dim
  int64_t vdim = 0;  // 0 = embed_dim
  bool batch_first = false;
  DType dtype = DType::float32;  // float32 or float64
  // Rotary position embedding (nn::rotate_positions_) with this base on the q
  // and k of every head, after the in-projection: query row l and key row s
  // sit at positions l and s (in forward_cached: cache.length + the new row).
  // Needs an even head dim; bias_k / the zero row are not rotated.
  std::optional<double> rotary_base;
  // bf16_mixed: the projections and the attention core take bfloat16
  // operands (q, k, v rounded after RoPE) with float32 sums; the output, the
  // returned weights and every gradient stay float32 (mha/nn/precision.h).
  // Saved for backward then in bfloat16: the inputs, q, k, v and the heads.
  Precision precision = Precision::float32;
  // The attention each head computes: full (torch's), or a window or an
  // efficient variant, with what each of them refuses (attention_variant.h).
  AttentionVariant attention;
};

struct MultiheadAttentionInputs {
  Tensor key_padding_mask;       // undefined = none
  bool need_weights = true;
  Tensor attn_mask;              // undefined = none
  bool average_attn_weights = true;
  bool is_causal = false;        // adds a top-left causal mask (and-ed with attn_mask)
  // Added to the logits of every head with the masks (ALiBi, T5's relative
  // bias): float (1 or N, H, L, S) in the module's dtype. attn_bias_grad: the
  // next backward returns its gradient (summed over a broadcast batch dim).
  Tensor attn_bias;              // undefined = none
  bool attn_bias_grad = false;
};

struct MultiheadAttentionOutput {
  Tensor output;
  Tensor weights;  // undefined unless need_weights
};

struct MultiheadAttentionInputGradients {
  Tensor dquery, dkey, dvalue;  // for self-attention (one tensor passed three times) add them
  Tensor dattn_bias;            // attn_bias's shape; defined when the forward asked for it
};

// Keys and values of the tokens decoded so far, as forward_cached projected
// (and rotated) them: (N, capacity, D) buffers (bfloat16 under bf16_mixed,
// else the module's dtype) whose first `length` rows hold
// tokens 0 … length − 1. The capacity doubles when full, so appending a token
// costs O(D) amortised. An empty cache ({}) starts a sequence.
struct KVCache {
  Tensor key, value;
  int64_t length = 0;
};

// The memory each attention call of a layer in training mode may spend
// keeping its scores for the backward (AttentionOptions::keep_scores_bytes),
// per call, in bytes: the backward then skips one of its five products.
// Process-wide; 256 MiB unless set (a causal call of 8 heads at L = 2040 keeps
// ~66 MiB; at L = 16384, 4 GiB: that one recomputes them); 0 keeps none.
// Throws ValueError below 0.
void set_score_memory_limit(int64_t bytes);
int64_t score_memory_limit();

class MultiheadAttention : public Module {
 public:
  // Initialised as torch does: Xavier-uniform in-projections, zero biases,
  // out_proj weight uniform in ±1/sqrt(D), bias_k/bias_v Xavier-normal.
  MultiheadAttention(const MultiheadAttentionConfig& config, Generator& gen);

  const MultiheadAttentionConfig& config() const { return config_; }
  int64_t num_heads() const { return config_.num_heads; }
  int64_t head_dim() const { return config_.head_dim; }
  int64_t inner_dim() const { return config_.num_heads * config_.head_dim; }  // I
  bool packed_in_proj() const { return packed_; }

  // Torch's names: in_proj_weight or q/k/v_proj_weight, in_proj_bias, bias_k,
  // bias_v, out_proj.weight, out_proj.bias (those that exist for the config);
  // then linformer.key_projection and linformer.value_projection (k,
  // max_length) for the linformer variant.
  std::vector<NamedParameter> named_parameters() override;

  // Draws each training forward's dropout seed; set its state to replay one.
  Generator& dropout_generator() { return dropout_gen_; }
  // Performer's features are drawn from feature_generator: one counter per
  // training forward, a new draw every redraw_every of them.
  std::vector<NamedGenerator> named_generators() override;

  // Saves what backward needs (the last call's inputs and activations).
  MultiheadAttentionOutput forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                   const MultiheadAttentionInputs& inputs = {});

  // Gradients of the last forward's inputs; adds into every parameter's grad.
  // dweights: the gradient of the returned weights (their shape: averaged or
  // per head, as the forward returned them) when a loss used them.
  // summed (self-attention, one tensor passed as query, key and value):
  // dquery holds dquery + dkey + dvalue, and dkey and dvalue are undefined.
  // With the packed projection (kdim = vdim = embed_dim) and no extra key
  // rows, that sum costs one product, 3·H·head_dim deep, in place of three
  // products and two additions. Query, key and value must share a shape.
  MultiheadAttentionInputGradients backward(const Tensor& doutput, const Tensor& dweights = {}, bool summed = false);
  void release_activations() override { saved_.reset(); }

  // Self-attention for decoding (inference: no dropout, nothing saved for
  // backward). x (L, N, D), (N, L, D) when batch_first, or (L, D): L new
  // tokens at positions cache.length … cache.length + L − 1. Their keys and
  // values are appended to `cache`, and each new row attends to every cached
  // row; with is_causal only to those up to itself (Causal::bottom_right).
  // Of `inputs`, is_causal and attn_bias (1 or N, H, L, cache.length + L) are
  // used (no weights are returned); masks are refused, and so are kdim or
  // vdim ≠ embed_dim, add_bias_kv and add_zero_attn. The output equals the
  // new rows of forward(x_all, x_all, x_all) over the whole sequence, at
  // O(cache.length · D) work per new token.
  Tensor forward_cached(const Tensor& x, KVCache& cache, const MultiheadAttentionInputs& inputs = {});

  void train(bool on = true) override;  // also drops the bfloat16 weight copies

  // Head gates (Michel et al. 2019): head h's output is multiplied by gate h
  // before the output projection, in forward, the cached and the memory
  // forwards. Undefined (the default): every gate 1, at no cost. Set, (H,)
  // in the module's dtype: each backward adds ∂L/∂gate_h into head_gate_grad,
  // the importance of head h; the gates are not parameters (no optimizer
  // step, not in checkpoints). A gate of 0 computes what the module with that
  // head pruned computes. set_head_gates validates, zeroes head_gate_grad, and
  // clears both with an undefined tensor.
  void set_head_gates(const Tensor& gates);
  const Tensor& head_gates() const { return head_gate_; }
  const Tensor& head_gate_grad() const { return head_gate_grad_; }
  void zero_head_gate_grad();
  // Removes the listed heads (indices into 0 … H − 1; repeats count once), as
  // Hugging Face's prune_heads: their rows of Wq, Wk, Wv and of the in-bias
  // (bias_k, bias_v) and their columns of Wo go, with the gradients and the
  // gates of the remaining heads kept. The module then computes what it
  // computed with those heads' gates at 0 (the same output, the same
  // gradients of what remains). num_heads shrinks, head_dim stays; drops what
  // the last forward saved.
  void prune_heads(const std::vector<int64_t>& heads);
  // Cross-attention for decoding (inference): the keys and values of a
  // memory that stays the same while queries arrive step by step, projected
  // once. key (S, N, kdim) and value (S, N, vdim) as forward's (batch_first:
  // (N, S, ·); unbatched (S, ·)) → a KVCache of (N, S, D) and length S.
  // Refused with rotary_base, add_bias_kv or add_zero_attn.
  KVCache project_memory(const Tensor& key, const Tensor& value);
  // query's rows against that memory: equal to the rows of forward(query_all,
  // key, value) with the same masks. Of `inputs`, key_padding_mask (N, S) and
  // attn_mask (L, S) or (N·H, L, S) apply (no weights are returned); is_causal
  // and attn_bias are refused. O(S · D) attention work per query row.
  Tensor forward_memory(const Tensor& query, const KVCache& memory, const MultiheadAttentionInputs& inputs = {});

  // Parameters, public so that tests and tools can set them.
  Tensor in_proj_weight, q_proj_weight, k_proj_weight, v_proj_weight, in_proj_bias;
  Tensor bias_k, bias_v, out_proj_weight, out_proj_bias;
  Tensor linformer_key_projection, linformer_value_projection;
  Tensor linformer_key_projection_grad, linformer_value_projection_grad;
  Tensor in_proj_weight_grad, q_proj_weight_grad, k_proj_weight_grad, v_proj_weight_grad,
      in_proj_bias_grad, bias_k_grad, bias_v_grad, out_proj_weight_grad, out_proj_bias_grad;

 private:
  struct Saved;
  MultiheadAttentionConfig config_;
  bool packed_ = true;
  Generator dropout_gen_, feature_gen_;
  std::shared_ptr<Saved> saved_;
  Bf16Weights bf16_;
  Tensor head_gate_, head_gate_grad_;

  // Wq, Wk, Wv, Wo as the products' operands: the parameters, or under
  // bf16_mixed their bfloat16 copies (made afresh when `refresh`).
  std::vector<Tensor> product_weights(bool refresh);
  MultiheadAttentionOutput forward_without_heads(const Tensor& query, const Tensor& key, const Tensor& value,
                                                 const MultiheadAttentionInputs& inputs, std::shared_ptr<Saved> saved);
  // Performer: the seed of the features for this forward (advancing the
  // draw counter when training; in eval, the last training draw's).
  uint64_t feature_seed();
};

}  // namespace mha::nn
