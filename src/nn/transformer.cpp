// TransformerEncoderLayer: residual blocks around self-attention and the
// feed-forward network; backward runs the blocks in reverse, adding the
// residual path's gradient to each block's.
#include "mha/nn/transformer.h"

#include "nn/layer_util.h"

namespace mha::nn {

namespace {
constexpr const char* kCtor = "mha::nn::TransformerEncoderLayer";
}  // namespace

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

TransformerEncoderLayer::TransformerEncoderLayer(const TransformerEncoderLayerConfig& c, Generator& gen)
    : self_attn({.embed_dim = c.d_model, .num_heads = c.nhead, .dropout = c.dropout, .batch_first = c.batch_first,
                 .dtype = c.dtype},
                gen),
      linear1({.in_features = c.d_model, .out_features = c.dim_feedforward, .dtype = c.dtype}, gen),
      linear2({.in_features = c.dim_feedforward, .out_features = c.d_model, .dtype = c.dtype}, gen),
      norm1({.normalized_shape = c.d_model, .eps = c.layer_norm_eps, .dtype = c.dtype}),
      norm2({.normalized_shape = c.d_model, .eps = c.layer_norm_eps, .dtype = c.dtype}),
      dropout(c.dropout, gen),
      dropout1(c.dropout, gen),
      dropout2(c.dropout, gen),
      config_(c) {
  (void)kCtor;
}

std::vector<NamedParameter> TransformerEncoderLayer::named_parameters() {
  std::vector<NamedParameter> out;
  append_parameters(out, "self_attn", self_attn);
  append_parameters(out, "linear1", linear1);
  append_parameters(out, "linear2", linear2);
  append_parameters(out, "norm1", norm1);
  append_parameters(out, "norm2", norm2);
  return out;
}

void TransformerEncoderLayer::train(bool on) {
  Module::train(on);
  for (Module* m : std::initializer_list<Module*>{&self_attn, &linear1, &linear2, &norm1, &norm2, &dropout, &dropout1,
                                                  &dropout2, &relu_, &gelu_})
    m->train(on);
}

Tensor TransformerEncoderLayer::self_attention_block(const Tensor& x, const EncoderInputs& in) {
  const MultiheadAttentionOutput a = self_attn.forward(
      x, x, x,
      {.key_padding_mask = in.src_key_padding_mask, .need_weights = false, .attn_mask = in.src_mask, .is_causal = in.is_causal});
  return dropout1.forward(a.output);
}

Tensor TransformerEncoderLayer::self_attention_block_backward(const Tensor& dy) {
  const MultiheadAttentionInputGradients g = self_attn.backward(dropout1.backward(dy));
  return add(add(g.dquery, g.dkey), g.dvalue);  // x was query, key and value
}

Tensor TransformerEncoderLayer::feed_forward_block(const Tensor& x) {
  Tensor h = linear1.forward(x);
  h = config_.activation == Activation::relu ? relu_.forward(h) : gelu_.forward(h);
  return dropout2.forward(linear2.forward(dropout.forward(h)));
}

Tensor TransformerEncoderLayer::feed_forward_block_backward(const Tensor& dy) {
  Tensor g = dropout.backward(linear2.backward(dropout2.backward(dy)));
  g = config_.activation == Activation::relu ? relu_.backward(g) : gelu_.backward(g);
  return linear1.backward(g);
}

Tensor TransformerEncoderLayer::forward(const Tensor& src, const EncoderInputs& in) {
  forwarded_ = true;
  if (config_.norm_first) {
    const Tensor h = add(src, self_attention_block(norm1.forward(src), in));
    return add(h, feed_forward_block(norm2.forward(h)));
  }
  const Tensor h = norm1.forward(add(src, self_attention_block(src, in)));
  return norm2.forward(add(h, feed_forward_block(h)));
}

Tensor TransformerEncoderLayer::backward(const Tensor& dy) {
  if (!forwarded_)
    throw StateError("[mha::nn::TransformerEncoderLayer::backward] state: expected a forward call first; got none");
  if (config_.norm_first) {
    const Tensor dh = add(dy, norm2.backward(feed_forward_block_backward(dy)));
    return add(dh, norm1.backward(self_attention_block_backward(dh)));
  }
  const Tensor g2 = norm2.backward(dy);
  const Tensor g1 = norm1.backward(add(g2, feed_forward_block_backward(g2)));
  return add(g1, self_attention_block_backward(g1));
}

}  // namespace mha::nn
