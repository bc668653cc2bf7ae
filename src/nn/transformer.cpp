// TransformerEncoderLayer: residual blocks around self-attention and the
// feed-forward network; backward runs the blocks in reverse, adding the
// residual path's gradient to each block's.
#include "mha/nn/transformer.h"

#include "cpu/layers/layers.h"
#include "nn/layer_util.h"
#include "nn/mixed_precision.h"

namespace mha::nn {

Tensor add(const Tensor& a_in, const Tensor& b_in) {
  const char* fn = "mha::nn::add";
  check_defined(a_in, fn, "a");
  check_defined(b_in, fn, "b");
  if (a_in.shape() != b_in.shape()) raise<ShapeError>(fn, "b", "a's shape " + shape_string(a_in.shape()), shape_string(b_in.shape()));
  if (a_in.dtype() != b_in.dtype()) raise<DtypeError>(fn, "b", "a's dtype " + to_string(a_in.dtype()), to_string(b_in.dtype()));
  check_layer_dtype(a_in.dtype(), fn);
  const Tensor a = a_in.contiguous(), b = b_in.contiguous();
  Tensor out = Tensor::empty(a.shape(), a.dtype());
  if (a.dtype() == DType::float32) {
    cpu::add_arrays(a.data<float>(), b.data<float>(), out.data<float>(), a.numel());
    return out;
  }
  const double *x = a.data<double>(), *y = b.data<double>();
  double* z = out.data<double>();
  for (int64_t i = 0; i < a.numel(); ++i) z[i] = x[i] + y[i];
  return out;
}

namespace {

// Rotary positions and the attention variant apply to self-attention only.
MultiheadAttentionConfig attention_config(const TransformerEncoderLayerConfig& c, bool self_attention) {
  const AttentionVariant attention = self_attention ? c.attention : AttentionVariant{};
  const int64_t heads = self_attention ? c.self_heads : c.cross_heads;
  if (heads < -1)
    raise<ValueError>("mha::nn::TransformerEncoderLayer", self_attention ? "self_heads" : "cross_heads",
                      ">= 0, or -1 (nhead)", std::to_string(heads));
  if (heads >= 0 && (c.nhead <= 0 || c.d_model % c.nhead != 0))
    raise<ValueError>("mha::nn::TransformerEncoderLayer", "d_model", "a multiple of nhead = " + std::to_string(c.nhead) +
                      " (the head dim of every layer)", std::to_string(c.d_model));
  return {.embed_dim = c.d_model, .num_heads = heads >= 0 ? heads : c.nhead,
          .head_dim = heads >= 0 ? c.d_model / c.nhead : 0, .dropout = attention.computes_weights() ? c.dropout : 0.0,
          .batch_first = c.batch_first, .dtype = c.dtype, .rotary_base = self_attention ? c.rotary_base : std::nullopt,
          .precision = c.precision, .attention = attention};
}

LinearConfig feed_forward_config(const TransformerEncoderLayerConfig& c, int64_t in, int64_t out) {
  return {.in_features = in, .out_features = out, .dtype = c.dtype, .precision = c.precision};
}

// dropout(attention(q, kv, kv)): one attention block of a layer; per-head
// weights into *weights when it is not null.
Tensor attention_block(MultiheadAttention& attention, Dropout& drop, const Tensor& q, const Tensor& kv,
                       const Tensor& attn_mask, const Tensor& key_padding_mask, bool is_causal,
                       Tensor* weights = nullptr, const Tensor& attn_bias = {}, bool attn_bias_grad = false) {
  MultiheadAttentionOutput out = attention.forward(
      q, kv, kv,
      {.key_padding_mask = key_padding_mask, .need_weights = weights != nullptr, .attn_mask = attn_mask,
       .average_attn_weights = false, .is_causal = is_causal, .attn_bias = attn_bias,
       .attn_bias_grad = attn_bias_grad});
  if (weights) *weights = out.weights;
  return drop.forward(out.output);
}

// Gradients of an attention block's query input, of its key/value input and
// of its attn_bias (when asked for).
struct BlockGradients {
  Tensor dquery, dkv, dbias;
};

BlockGradients attention_block_backward(MultiheadAttention& attention, Dropout& drop, const Tensor& dy,
                                        const Tensor& dweights = {}) {
  const MultiheadAttentionInputGradients g = attention.backward(drop.backward(dy), dweights);
  return {g.dquery, add(g.dkey, g.dvalue), g.dattn_bias};
}

// out_drop(linear2(inner_drop(activation(linear1(x))))): the feed-forward block.
// Under bf16-mixed, linear2 reads the activation's output only as bfloat16
// operands, so the activation writes them (one pass of 2 bytes an element
// instead of 4 written, 4 read back and 2 written by a rounding pass), unless
// dropout stands between the two.
Tensor feed_forward(Linear& l1, ActivationLayer& act, Dropout& inner, Linear& l2, Dropout& out_drop, const Tensor& x) {
  const LinearConfig& c = l2.config();
  const DType mid = inner.active() ? c.dtype : operand_dtype(c.dtype, c.precision);
  return out_drop.forward(l2.forward(inner.forward(act.forward(l1.forward(x), mid))));
}

// linear1's bias gradient is summed in the activation's backward sweep (one
// pass less over the (rows × dim_feedforward) gradient), which then writes
// the gradient as linear1's products take it (bfloat16 under bf16-mixed).
Tensor feed_forward_backward(Linear& l1, ActivationLayer& act, Dropout& inner, Linear& l2, Dropout& out_drop,
                             const Tensor& dy) {
  const Tensor g = inner.backward(l2.backward(out_drop.backward(dy)));
  const DType out = operand_dtype(l1.config().dtype, l1.config().precision);
  if (!l1.bias_grad.defined()) return l1.backward(act.backward(g, out));
  return l1.backward(act.backward(g, l1.bias_grad, out), /*bias_grad_added=*/true);
}

// A self-attention block's backward: x fed it as query, key and value, so
// x's gradient is the sum; the gradient of its attn_bias into *dbias.
Tensor self_attention_backward(MultiheadAttention& attention, Dropout& drop, const Tensor& dy, Tensor& dbias,
                               const Tensor& dweights = {}) {
  const MultiheadAttentionInputGradients g = attention.backward(drop.backward(dy), dweights, /*summed=*/true);
  dbias = g.dattn_bias;
  return g.dquery;
}

// One residual block around f: Pre-LN x + f(norm(x)), Post-LN norm(x + f(x))
// (the sum and the norm in one sweep).
template <class F>
Tensor residual(bool norm_first, LayerNorm& norm, const Tensor& x, F&& f) {
  Tensor sum;
  return norm_first ? add(x, f(norm.forward(x))) : norm.forward_sum(x, f(x), &sum);
}

// Pre-LN blocks in a row, x + f(norm_a(x)) then the next block's norm_b of
// that sum: both in one sweep. Returns norm_b(h) and the sum h in *sum.
template <class F>
Tensor pre_norm_block(LayerNorm& norm_a, LayerNorm& norm_b, const Tensor& x, Tensor* sum, F&& f) {
  return norm_b.forward_sum(x, f(norm_a.forward(x)), sum);
}

// Its backward; df maps the gradient of f's output to that of its input.
//   Pre-LN: dx = dy + norm'(df(dy));  Post-LN: g = norm'(dy), dx = g + df(g).
template <class F>
Tensor residual_backward(bool norm_first, LayerNorm& norm, const Tensor& dy, F&& df) {
  if (norm_first) return norm.backward_add(df(dy), dy);
  const Tensor g = norm.backward(dy);
  return add(g, df(g));
}

// Runs a checkpointed layer's forward again as it first ran: the mode and the
// generator states of then, so every dropout draws the same seed. The layer's
// generators and mode are left as they were before.
template <class Layer, class Inputs, class F>
void rerun_forward(Layer& layer, const ForwardReplay<Inputs>& replay, F&& forward) {
  const std::vector<Generator> now = generator_states(layer);
  const bool mode = layer.is_training();
  set_generator_states(layer, replay.generators);
  layer.train(replay.training);
  forward();
  set_generator_states(layer, now);
  layer.train(mode);
}

}  // namespace

TransformerEncoderLayer::TransformerEncoderLayer(const TransformerEncoderLayerConfig& c, Generator& gen)
    : self_attn(attention_config(c, true), gen),
      linear1(feed_forward_config(c, c.d_model, c.dim_feedforward), gen),
      linear2(feed_forward_config(c, c.dim_feedforward, c.d_model), gen),
      norm1({.normalized_shape = c.d_model, .eps = c.layer_norm_eps, .dtype = c.dtype}),
      norm2({.normalized_shape = c.d_model, .eps = c.layer_norm_eps, .dtype = c.dtype}),
      dropout(c.dropout, gen),
      dropout1(c.dropout, gen),
      dropout2(c.dropout, gen),
      config_(c),
      activation_(c.activation) {}

std::vector<NamedParameter> TransformerEncoderLayer::named_parameters() {
  std::vector<NamedParameter> out;
  append_parameters(out, "self_attn", self_attn);
  append_parameters(out, "linear1", linear1);
  append_parameters(out, "linear2", linear2);
  append_parameters(out, "norm1", norm1);
  append_parameters(out, "norm2", norm2);
  return out;
}

std::vector<NamedGenerator> TransformerEncoderLayer::named_generators() {
  std::vector<NamedGenerator> out;
  append_generators(out, "self_attn", self_attn);
  append_generators(out, "dropout", dropout);
  append_generators(out, "dropout1", dropout1);
  append_generators(out, "dropout2", dropout2);
  return out;
}

std::vector<Module*> TransformerEncoderLayer::children() {
  return {&self_attn, &linear1, &linear2, &norm1, &norm2, &dropout, &dropout1, &dropout2, &activation_};
}

void TransformerEncoderLayer::train(bool on) {
  Module::train(on);
  for (Module* m : children()) m->train(on);
}

void TransformerEncoderLayer::release_activations() {
  for (Module* m : children()) m->release_activations();
  replay_ = {};
}

Tensor TransformerEncoderLayer::forward_blocks(const Tensor& src, const EncoderInputs& in) {
  weights_ = Tensor();
  auto sa = [&](const Tensor& x) {
    return attention_block(self_attn, dropout1, x, x, in.src_mask, in.src_key_padding_mask, in.is_causal,
                           in.need_weights ? &weights_ : nullptr, in.attn_bias, in.attn_bias_grad);
  };
  auto ff = [&](const Tensor& x) { return feed_forward(linear1, activation_, dropout, linear2, dropout2, x); };
  if (config_.norm_first) {
    Tensor h;
    const Tensor normed = pre_norm_block(norm1, norm2, src, &h, sa);
    return add(h, ff(normed));
  }
  return residual(false, norm2, residual(false, norm1, src, sa), ff);
}

Tensor TransformerEncoderLayer::forward(const Tensor& src, const EncoderInputs& in) {
  forwarded_ = true;
  if (!config_.checkpoint_activations) return forward_blocks(src, in);
  ForwardReplay<EncoderInputs> replay{src, {}, in, training_, generator_states(*this)};
  const Tensor out = forward_blocks(src, in);
  release_activations();
  replay_ = std::move(replay);
  return out;
}

Tensor TransformerEncoderLayer::forward_cached(const Tensor& src, KVCache& cache, const EncoderInputs& in) {
  auto sa = [&](const Tensor& x) {
    return dropout1.forward(self_attn.forward_cached(x, cache, {.is_causal = in.is_causal, .attn_bias = in.attn_bias}));
  };
  auto ff = [&](const Tensor& x) { return feed_forward(linear1, activation_, dropout, linear2, dropout2, x); };
  return residual(config_.norm_first, norm2, residual(config_.norm_first, norm1, src, sa), ff);
}

Tensor TransformerEncoderLayer::backward(const Tensor& dy, const Tensor& dweights) {
  if (!forwarded_)
    throw StateError("[mha::nn::TransformerEncoderLayer::backward] state: expected a forward call first; got none");
  const bool checkpointed = config_.checkpoint_activations;
  if (checkpointed) rerun_forward(*this, replay_, [&] { forward_blocks(replay_.input, replay_.inputs); });
  auto sa = [&](const Tensor& g) {
    return self_attention_backward(self_attn, dropout1, g, attn_bias_grad_, dweights);
  };
  auto ff = [&](const Tensor& g) { return feed_forward_backward(linear1, activation_, dropout, linear2, dropout2, g); };
  const Tensor dh = residual_backward(config_.norm_first, norm2, dy, ff);
  const Tensor dx = residual_backward(config_.norm_first, norm1, dh, sa);
  if (checkpointed)  // the recomputed intermediates go, the replay stays
    for (Module* m : children()) m->release_activations();
  return dx;
}

TransformerDecoderLayer::TransformerDecoderLayer(const TransformerDecoderLayerConfig& c, Generator& gen)
    : self_attn(attention_config(c, true), gen),
      multihead_attn(attention_config(c, false), gen),
      linear1(feed_forward_config(c, c.d_model, c.dim_feedforward), gen),
      linear2(feed_forward_config(c, c.dim_feedforward, c.d_model), gen),
      norm1({.normalized_shape = c.d_model, .eps = c.layer_norm_eps, .dtype = c.dtype}),
      norm2({.normalized_shape = c.d_model, .eps = c.layer_norm_eps, .dtype = c.dtype}),
      norm3({.normalized_shape = c.d_model, .eps = c.layer_norm_eps, .dtype = c.dtype}),
      dropout(c.dropout, gen),
      dropout1(c.dropout, gen),
      dropout2(c.dropout, gen),
      dropout3(c.dropout, gen),
      config_(c),
      activation_(c.activation) {}

std::vector<NamedParameter> TransformerDecoderLayer::named_parameters() {
  std::vector<NamedParameter> out;
  append_parameters(out, "self_attn", self_attn);
  append_parameters(out, "multihead_attn", multihead_attn);
  append_parameters(out, "linear1", linear1);
  append_parameters(out, "linear2", linear2);
  append_parameters(out, "norm1", norm1);
  append_parameters(out, "norm2", norm2);
  append_parameters(out, "norm3", norm3);
  return out;
}

std::vector<NamedGenerator> TransformerDecoderLayer::named_generators() {
  std::vector<NamedGenerator> out;
  append_generators(out, "self_attn", self_attn);
  append_generators(out, "multihead_attn", multihead_attn);
  append_generators(out, "dropout", dropout);
  append_generators(out, "dropout1", dropout1);
  append_generators(out, "dropout2", dropout2);
  append_generators(out, "dropout3", dropout3);
  return out;
}

std::vector<Module*> TransformerDecoderLayer::children() {
  return {&self_attn, &multihead_attn, &linear1, &linear2,  &norm1,    &norm2,
          &norm3,     &dropout,        &dropout1, &dropout2, &dropout3, &activation_};
}

void TransformerDecoderLayer::train(bool on) {
  Module::train(on);
  for (Module* m : children()) m->train(on);
}

void TransformerDecoderLayer::release_activations() {
  for (Module* m : children()) m->release_activations();
  replay_ = {};
}

Tensor TransformerDecoderLayer::forward_blocks(const Tensor& tgt, const Tensor& memory, const DecoderInputs& in) {
  weights_ = cross_weights_ = Tensor();
  auto sa = [&](const Tensor& x) {
    return attention_block(self_attn, dropout1, x, x, in.tgt_mask, in.tgt_key_padding_mask, in.tgt_is_causal,
                           in.need_weights ? &weights_ : nullptr, in.tgt_attn_bias, in.tgt_attn_bias_grad);
  };
  auto ca = [&](const Tensor& x) {
    return attention_block(multihead_attn, dropout2, x, memory, in.memory_mask, in.memory_key_padding_mask,
                           in.memory_is_causal, in.need_weights ? &cross_weights_ : nullptr);
  };
  auto ff = [&](const Tensor& x) { return feed_forward(linear1, activation_, dropout, linear2, dropout3, x); };
  if (config_.norm_first) {
    Tensor h1, h2;
    const Tensor normed2 = pre_norm_block(norm1, norm2, tgt, &h1, sa);
    const Tensor normed3 = norm3.forward_sum(h1, ca(normed2), &h2);
    return add(h2, ff(normed3));
  }
  const Tensor h1 = residual(false, norm1, tgt, sa);
  const Tensor h2 = residual(false, norm2, h1, ca);
  return residual(false, norm3, h2, ff);
}

Tensor TransformerDecoderLayer::forward(const Tensor& tgt, const Tensor& memory, const DecoderInputs& in) {
  forwarded_ = true;
  if (!config_.checkpoint_activations) return forward_blocks(tgt, memory, in);
  ForwardReplay<DecoderInputs> replay{tgt, memory, in, training_, generator_states(*this)};
  const Tensor out = forward_blocks(tgt, memory, in);
  release_activations();
  replay_ = std::move(replay);
  return out;
}

Tensor TransformerDecoderLayer::forward_cached(const Tensor& tgt, KVCache& cache, const KVCache& memory,
                                               const DecoderInputs& in) {
  auto sa = [&](const Tensor& x) {
    return dropout1.forward(self_attn.forward_cached(
        x, cache, {.key_padding_mask = in.tgt_key_padding_mask, .attn_mask = in.tgt_mask, .is_causal = in.tgt_is_causal,
                   .attn_bias = in.tgt_attn_bias}));
  };
  auto ca = [&](const Tensor& x) {
    return dropout2.forward(multihead_attn.forward_memory(
        x, memory, {.key_padding_mask = in.memory_key_padding_mask, .attn_mask = in.memory_mask,
                    .is_causal = in.memory_is_causal}));
  };
  auto ff = [&](const Tensor& x) { return feed_forward(linear1, activation_, dropout, linear2, dropout3, x); };
  const bool norm_first = config_.norm_first;
  const Tensor h1 = residual(norm_first, norm1, tgt, sa);
  const Tensor h2 = residual(norm_first, norm2, h1, ca);
  return residual(norm_first, norm3, h2, ff);
}

DecoderGradients TransformerDecoderLayer::backward(const Tensor& dy) {
  if (!forwarded_)
    throw StateError("[mha::nn::TransformerDecoderLayer::backward] state: expected a forward call first; got none");
  const bool checkpointed = config_.checkpoint_activations;
  if (checkpointed)
    rerun_forward(*this, replay_, [&] { forward_blocks(replay_.input, replay_.memory, replay_.inputs); });
  DecoderGradients out;
  auto sa = [&](const Tensor& g) { return self_attention_backward(self_attn, dropout1, g, attn_bias_grad_); };
  auto ca = [&](const Tensor& g) {
    const BlockGradients b = attention_block_backward(multihead_attn, dropout2, g);
    out.dmemory = b.dkv;
    return b.dquery;
  };
  auto ff = [&](const Tensor& g) { return feed_forward_backward(linear1, activation_, dropout, linear2, dropout3, g); };
  const bool norm_first = config_.norm_first;
  const Tensor dh2 = residual_backward(norm_first, norm3, dy, ff);
  const Tensor dh1 = residual_backward(norm_first, norm2, dh2, ca);
  out.dtgt = residual_backward(norm_first, norm1, dh1, sa);
  if (checkpointed)
    for (Module* m : children()) m->release_activations();
  return out;
}

}  // namespace mha::nn
