// VisionTransformer: patches in, the class token's (or, with axial
// attention, the patches' mean's) logits out.
#include "mha/nn/vision_transformer.h"

#include "mha/nn/transformer_stack.h"

#include "nn/layer_util.h"

namespace mha::nn {

namespace {

constexpr const char* kCtor = "mha::nn::VisionTransformer";

const VisionTransformerConfig& checked(const VisionTransformerConfig& c) {
  if (c.image_side < 1) raise<ValueError>(kCtor, "image_side", ">= 1", std::to_string(c.image_side));
  if (c.patch < 1 || c.image_side % c.patch != 0)
    raise<ValueError>(kCtor, "patch", "a divisor of image_side = " + std::to_string(c.image_side),
                      std::to_string(c.patch));
  if (c.classes < 2) raise<ValueError>(kCtor, "classes", ">= 2", std::to_string(c.classes));
  if (c.num_layers < 1) raise<ValueError>(kCtor, "num_layers", ">= 1", std::to_string(c.num_layers));
  return c;
}

// Small normal values, as ViT initialises its class token and positions.
Tensor small_normal(const Shape& shape, Generator& gen, DType dtype) { return randn(shape, gen, 0.0, 0.02, dtype); }

// Pixels (b, (r·p + y)·side + c·p + x) → patches (b, r·G + c, y·p + x).
template <class T>
void to_patches(const T* src, int64_t B, int64_t side, int64_t p, T* dst) {
  const int64_t G = side / p;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < G; ++r)
      for (int64_t c = 0; c < G; ++c)
        for (int64_t y = 0; y < p; ++y)
          for (int64_t x = 0; x < p; ++x) *dst++ = src[b * side * side + (r * p + y) * side + c * p + x];
}

// x (B, F + N, D) = [cls + pos_cls ; e + row_embed[r] + col_embed[c]], F = 1;
// without a class token (cls null, F = 0) the patches alone.
template <class T>
void add_tokens(const T* e, const T* cls, const T* pc, const T* re, const T* ce, int64_t B, int64_t G, int64_t D, T* x) {
  const int64_t N = G * G, F = cls ? 1 : 0;
  for (int64_t b = 0; b < B; ++b) {
    T* row = x + b * (N + F) * D;
    if (cls)
      for (int64_t d = 0; d < D; ++d) row[d] = cls[d] + pc[d];
    for (int64_t n = 0; n < N; ++n)
      for (int64_t d = 0; d < D; ++d)
        row[(n + F) * D + d] = e[(b * N + n) * D + d] + re[(n / G) * D + d] + ce[(n % G) * D + d];
  }
}

// The transpose of add_tokens: gradients of the token table and the embeddings.
template <class T>
void add_tokens_backward(const T* gx, int64_t B, int64_t G, int64_t D, T* dcls, T* dpc, T* dre, T* dce, T* de) {
  const int64_t N = G * G, F = dcls ? 1 : 0;
  for (int64_t b = 0; b < B; ++b) {
    const T* row = gx + b * (N + F) * D;
    if (dcls)
      for (int64_t d = 0; d < D; ++d) dcls[d] += row[d], dpc[d] += row[d];
    for (int64_t n = 0; n < N; ++n)
      for (int64_t d = 0; d < D; ++d) {
        const T v = row[(n + F) * D + d];
        de[(b * N + n) * D + d] = v;
        dre[(n / G) * D + d] += v;
        dce[(n % G) * D + d] += v;
      }
  }
}

}  // namespace

VisionTransformer::VisionTransformer(const VisionTransformerConfig& c, Generator& gen)
    : patch_embed({.in_features = checked(c).patch * c.patch, .out_features = c.d_model, .dtype = c.dtype}, gen),
      cls_token(small_normal({1, c.d_model}, gen, c.dtype)),
      pos_cls(small_normal({1, c.d_model}, gen, c.dtype)),
      row_embed(small_normal({c.image_side / c.patch, c.d_model}, gen, c.dtype)),
      col_embed(small_normal({c.image_side / c.patch, c.d_model}, gen, c.dtype)),
      cls_token_grad(Tensor::zeros({1, c.d_model}, c.dtype)),
      pos_cls_grad(Tensor::zeros({1, c.d_model}, c.dtype)),
      row_embed_grad(Tensor::zeros({c.image_side / c.patch, c.d_model}, c.dtype)),
      col_embed_grad(Tensor::zeros({c.image_side / c.patch, c.d_model}, c.dtype)),
      norm({.normalized_shape = c.d_model, .dtype = c.dtype}),
      head({.in_features = c.d_model, .out_features = c.classes, .dtype = c.dtype}, gen),
      config_(c) {
  // Axial attention reads the patches as the grid's rows: G positions each.
  if (pooled()) config_.attention.axial_width = grid();
  check_head_lists(c.heads, c.num_layers, c.nhead, "heads", "mha::nn::VisionTransformer");
  for (int64_t i = 0; i < c.num_layers; ++i)
    layers.push_back(std::make_unique<TransformerEncoderLayer>(
        TransformerEncoderLayerConfig{.d_model = c.d_model, .nhead = c.nhead, .dim_feedforward = c.dim_feedforward,
                                      .dropout = c.dropout, .activation = c.activation, .batch_first = true,
                                      .norm_first = true, .dtype = c.dtype, .attention = config_.attention,
                                      .self_heads = c.heads.empty() ? -1 : int64_t(c.heads[size_t(i)].size())},
        gen));
}

void VisionTransformer::prune_heads(int64_t layer, const std::vector<int64_t>& ids) {
  const char* fn = "mha::nn::VisionTransformer::prune_heads";
  if (layer < 0 || layer >= int64_t(layers.size()))
    raise<ValueError>(fn, "layer", "in [0, " + std::to_string(layers.size()) + ")", std::to_string(layer));
  prune_layer_heads(config_.heads, config_.num_layers, config_.nhead, layer, ids, layers[size_t(layer)]->self_attn, fn);
}

std::vector<NamedParameter> VisionTransformer::named_parameters() {
  std::vector<NamedParameter> out;
  append_parameters(out, "patch_embed", patch_embed);
  if (!pooled()) {
    out.push_back({"cls_token", &cls_token, &cls_token_grad});
    out.push_back({"pos_cls", &pos_cls, &pos_cls_grad});
  }
  out.push_back({"row_embed", &row_embed, &row_embed_grad});
  out.push_back({"col_embed", &col_embed, &col_embed_grad});
  for (size_t i = 0; i < layers.size(); ++i) append_parameters(out, "layers." + std::to_string(i), *layers[i]);
  append_parameters(out, "norm", norm);
  append_parameters(out, "head", head);
  return out;
}

std::vector<NamedGenerator> VisionTransformer::named_generators() {
  std::vector<NamedGenerator> out;
  for (size_t i = 0; i < layers.size(); ++i) append_generators(out, "layers." + std::to_string(i), *layers[i]);
  return out;
}

void VisionTransformer::train(bool on) {
  Module::train(on);
  for (auto& l : layers) l->train(on);
}

Tensor VisionTransformer::forward(const Tensor& images, bool need_weights) {
  const char* fn = "mha::nn::VisionTransformer::forward";
  const int64_t side = config_.image_side, p = config_.patch, G = grid(), N = G * G, D = config_.d_model;
  check_input(images, fn, "images", config_.dtype, side * side);
  if (images.dim() != 2) raise<ShapeError>(fn, "images", "(B, " + std::to_string(side * side) + ")", shape_string(images.shape()));
  const Tensor img = images.contiguous();
  batch_ = img.size(0);
  Tensor patches = Tensor::empty({batch_, N, p * p}, config_.dtype);
  const int64_t F = pooled() ? 0 : 1;
  Tensor x = Tensor::empty({batch_, F + N, D}, config_.dtype);
  dispatch_float(config_.dtype, [&](auto tag) {
    using T = decltype(tag);
    to_patches(img.data<T>(), batch_, side, p, patches.data<T>());
    const Tensor embedded = patch_embed.forward(patches);  // (B, N, D)
    add_tokens(embedded.data<T>(), F ? cls_token.data<T>() : nullptr, pos_cls.data<T>(), row_embed.data<T>(),
               col_embed.data<T>(), batch_, G, D, x.data<T>());
  });
  weights_.clear();
  for (auto& layer : layers) {
    x = layer->forward(x, {.need_weights = need_weights});
    if (need_weights) weights_.push_back(layer->last_attention_weights());
  }
  const Tensor normed = norm.forward(x);
  if (!pooled()) return head.forward(normed.select(1, 0).contiguous());  // (B, classes)
  Tensor mean = Tensor::zeros({batch_, D}, config_.dtype);
  dispatch_float(config_.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* t = normed.data<T>();
    T* m = mean.data<T>();
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t d = 0; d < D; ++d) m[b * D + d] += t[(b * N + n) * D + d] / T(N);
  });
  return head.forward(mean);
}

void VisionTransformer::backward(const Tensor& dlogits) {
  const int64_t G = grid(), N = G * G, D = config_.d_model;
  const Tensor dcls_out = head.backward(dlogits);  // (B, D)
  const int64_t F = pooled() ? 0 : 1;
  Tensor dnormed = Tensor::zeros({batch_, F + N, D}, config_.dtype);
  if (F) {
    dnormed.select(1, 0).copy_(dcls_out);
  } else {  // the mean's gradient, 1/N of it to every patch
    dispatch_float(config_.dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* g = dcls_out.data<T>();
      T* t = dnormed.data<T>();
      for (int64_t b = 0; b < batch_; ++b)
        for (int64_t n = 0; n < N; ++n)
          for (int64_t d = 0; d < D; ++d) t[(b * N + n) * D + d] = g[b * D + d] / T(N);
    });
  }
  Tensor dx = norm.backward(dnormed);
  for (size_t i = layers.size(); i-- > 0;) dx = layers[i]->backward(dx);
  const Tensor g = dx.contiguous();
  Tensor dembedded = Tensor::empty({batch_, N, D}, config_.dtype);
  dispatch_float(config_.dtype, [&](auto tag) {
    using T = decltype(tag);
    add_tokens_backward(g.data<T>(), batch_, G, D, F ? cls_token_grad.data<T>() : nullptr, pos_cls_grad.data<T>(),
                        row_embed_grad.data<T>(), col_embed_grad.data<T>(), dembedded.data<T>());
  });
  patch_embed.backward(dembedded);
}

}  // namespace mha::nn
