// TransformerEncoderLayer: residual blocks around self-attention and the
// feed-forward network; backward runs the blocks in reverse, adding the
// residual path's gradient to each block's.
#include "mha/nn/transformer.h"

#include "nn/layer_util.h"

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
  dispatch_float(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T *x = a.data<T>(), *y = b.data<T>();
    T* z = out.data<T>();
    for (int64_t i = 0; i < a.numel(); ++i) z[i] = x[i] + y[i];
  });
  return out;
}

namespace {

// Rotary positions apply to self-attention only.
MultiheadAttentionConfig attention_config(const TransformerEncoderLayerConfig& c, bool self_attention) {
  return {.embed_dim = c.d_model, .num_heads = c.nhead, .dropout = c.dropout, .batch_first = c.batch_first,
          .dtype = c.dtype, .rotary_base = self_attention ? c.rotary_base : std::nullopt, .precision = c.precision};
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

BlockGradients attention_block_backward(MultiheadAttention& attention, Dropout& drop, const Tensor& dy) {
  const MultiheadAttentionInputGradients g = attention.backward(drop.backward(dy));
  return {g.dquery, add(g.dkey, g.dvalue), g.dattn_bias};
}

// out_drop(linear2(inner_drop(activation(linear1(x))))): the feed-forward block.
Tensor feed_forward(Linear& l1, ActivationLayer& act, Dropout& inner, Linear& l2, Dropout& out_drop, const Tensor& x) {
  return out_drop.forward(l2.forward(inner.forward(act.forward(l1.forward(x)))));
}

Tensor feed_forward_backward(Linear& l1, ActivationLayer& act, Dropout& inner, Linear& l2, Dropout& out_drop,
                             const Tensor& dy) {
  return l1.backward(act.backward(inner.backward(l2.backward(out_drop.backward(dy)))));
}

void set_mode(bool on, std::initializer_list<Module*> modules) {
  for (Module* m : modules) m->train(on);
}

// The encoder layer's two residual blocks around self-attention `sa` and the
// feed-forward network `ff`, Pre-LN or Post-LN.
template <class SelfAttention, class FeedForward>
Tensor encoder_blocks(bool norm_first, LayerNorm& norm1, LayerNorm& norm2, const Tensor& src, SelfAttention&& sa,
                      FeedForward&& ff) {
  if (norm_first) {
    const Tensor h = add(src, sa(norm1.forward(src)));
    return add(h, ff(norm2.forward(h)));
  }
  const Tensor h = norm1.forward(add(src, sa(src)));
  return norm2.forward(add(h, ff(h)));
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

void TransformerEncoderLayer::train(bool on) {
  Module::train(on);
  set_mode(on, {&self_attn, &linear1, &linear2, &norm1, &norm2, &dropout, &dropout1, &dropout2, &activation_});
}

Tensor TransformerEncoderLayer::forward(const Tensor& src, const EncoderInputs& in) {
  forwarded_ = true;
  weights_ = Tensor();
  auto sa = [&](const Tensor& x) {
    return attention_block(self_attn, dropout1, x, x, in.src_mask, in.src_key_padding_mask, in.is_causal,
                           in.need_weights ? &weights_ : nullptr, in.attn_bias, in.attn_bias_grad);
  };
  auto ff = [&](const Tensor& x) { return feed_forward(linear1, activation_, dropout, linear2, dropout2, x); };
  return encoder_blocks(config_.norm_first, norm1, norm2, src, sa, ff);
}

Tensor TransformerEncoderLayer::forward_cached(const Tensor& src, KVCache& cache, const EncoderInputs& in) {
  auto sa = [&](const Tensor& x) {
    return dropout1.forward(self_attn.forward_cached(x, cache, {.is_causal = in.is_causal, .attn_bias = in.attn_bias}));
  };
  auto ff = [&](const Tensor& x) { return feed_forward(linear1, activation_, dropout, linear2, dropout2, x); };
  return encoder_blocks(config_.norm_first, norm1, norm2, src, sa, ff);
}

Tensor TransformerEncoderLayer::backward(const Tensor& dy) {
  if (!forwarded_)
    throw StateError("[mha::nn::TransformerEncoderLayer::backward] state: expected a forward call first; got none");
  // x fed the block as query, key and value: its gradient is the sum.
  auto sa = [&](const Tensor& g) {
    const BlockGradients b = attention_block_backward(self_attn, dropout1, g);
    attn_bias_grad_ = b.dbias;
    return add(b.dquery, b.dkv);
  };
  auto ff = [&](const Tensor& g) { return feed_forward_backward(linear1, activation_, dropout, linear2, dropout2, g); };
  if (config_.norm_first) {
    const Tensor dh = add(dy, norm2.backward(ff(dy)));
    return add(dh, norm1.backward(sa(dh)));
  }
  const Tensor g2 = norm2.backward(dy);
  const Tensor g1 = norm1.backward(add(g2, ff(g2)));
  return add(g1, sa(g1));
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

void TransformerDecoderLayer::train(bool on) {
  Module::train(on);
  set_mode(on, {&self_attn, &multihead_attn, &linear1, &linear2, &norm1, &norm2, &norm3, &dropout, &dropout1,
                &dropout2, &dropout3, &activation_});
}

Tensor TransformerDecoderLayer::forward(const Tensor& tgt, const Tensor& memory, const DecoderInputs& in) {
  forwarded_ = true;
  auto sa = [&](const Tensor& x) {
    return attention_block(self_attn, dropout1, x, x, in.tgt_mask, in.tgt_key_padding_mask, in.tgt_is_causal);
  };
  auto ca = [&](const Tensor& x) {
    return attention_block(multihead_attn, dropout2, x, memory, in.memory_mask, in.memory_key_padding_mask,
                           in.memory_is_causal);
  };
  auto ff = [&](const Tensor& x) { return feed_forward(linear1, activation_, dropout, linear2, dropout3, x); };
  if (config_.norm_first) {
    const Tensor h1 = add(tgt, sa(norm1.forward(tgt)));
    const Tensor h2 = add(h1, ca(norm2.forward(h1)));
    return add(h2, ff(norm3.forward(h2)));
  }
  const Tensor h1 = norm1.forward(add(tgt, sa(tgt)));
  const Tensor h2 = norm2.forward(add(h1, ca(h1)));
  return norm3.forward(add(h2, ff(h2)));
}

DecoderGradients TransformerDecoderLayer::backward(const Tensor& dy) {
  if (!forwarded_)
    throw StateError("[mha::nn::TransformerDecoderLayer::backward] state: expected a forward call first; got none");
  auto sa = [&](const Tensor& g) {
    const BlockGradients b = attention_block_backward(self_attn, dropout1, g);
    return add(b.dquery, b.dkv);
  };
  auto ff = [&](const Tensor& g) { return feed_forward_backward(linear1, activation_, dropout, linear2, dropout3, g); };
  DecoderGradients out;
  if (config_.norm_first) {
    const Tensor dh2 = add(dy, norm3.backward(ff(dy)));
    const BlockGradients c = attention_block_backward(multihead_attn, dropout2, dh2);
    const Tensor dh1 = add(dh2, norm2.backward(c.dquery));
    out.dtgt = add(dh1, norm1.backward(sa(dh1)));
    out.dmemory = c.dkv;
    return out;
  }
  const Tensor g3 = norm3.backward(dy);
  const Tensor g2 = norm2.backward(add(g3, ff(g3)));
  const BlockGradients c = attention_block_backward(multihead_attn, dropout2, g2);
  const Tensor g1 = norm1.backward(add(g2, c.dquery));
  out.dtgt = add(g1, sa(g1));
  out.dmemory = c.dkv;
  return out;
}

}  // namespace mha::nn
