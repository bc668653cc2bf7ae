// A Vision Transformer (Dosovitskiy et al.) for small grey images:
//   images (B, side·side) → patches (B, N, p·p), N = (side/p)², row-major
//   → patch_embed: Linear(p·p → D)
//   → [class token ; patches] + positions: the class token's own vector, and
//     for patch (r, c) row_embed[r] + col_embed[c] (2-D, separable)
//   → num_layers × TransformerEncoderLayer (Pre-LN, batch_first, no mask)
//   → norm → the class token's vector → head: Linear(D → classes) → logits (B, classes)
// With axial attention (config.attention.kind = axial) the layers attend
// along the G × G grid's rows, then its columns (axial.h), which leaves no
// place for a class token: the head reads the mean of the patches' vectors
// instead (and cls_token, pos_cls are not parameters).
// backward(dlogits) accumulates every parameter's gradient.
#pragma once

#include <memory>
#include <vector>

#include "mha/nn/transformer.h"

namespace mha::nn {

struct VisionTransformerConfig {
  int64_t image_side = 8;
  int64_t patch = 2;            // must divide image_side
  int64_t classes = 10;
  int64_t d_model = 64;
  int64_t nhead = 4;
  int64_t num_layers = 2;
  int64_t dim_feedforward = 128;
  double dropout = 0.0;
  Activation activation = Activation::gelu;
  DType dtype = DType::float32;  // float32 or float64
  // The layers' attention: full, axial (its width is set to the grid's), or
  // another variant of attention_variant.h over the N + 1 tokens.
  AttentionVariant attention;
  // The heads each layer keeps, by id in [0, nhead) (TransformerStackConfig::heads); empty = nhead each.
  std::vector<std::vector<int64_t>> heads;
};

class VisionTransformer : public Module {
 public:
  VisionTransformer(const VisionTransformerConfig& config, Generator& gen);
  const VisionTransformerConfig& config() const { return config_; }
  int64_t grid() const { return config_.image_side / config_.patch; }  // patches per side
  bool pooled() const { return config_.attention.kind == AttentionKind::axial; }  // mean of patches, no class token

  // patch_embed.*, cls_token, pos_cls (unless pooled), row_embed, col_embed, layers.N.*, norm.*, head.*
  std::vector<NamedParameter> named_parameters() override;
  std::vector<NamedGenerator> named_generators() override;
  void train(bool on = true) override;

  // images (B, side·side) float32 → logits (B, classes). need_weights keeps
  // each layer's (B, H, N+1, N+1) attention in attention_weights().
  Tensor forward(const Tensor& images, bool need_weights = false);
  void backward(const Tensor& dlogits);
  // Removes heads (by id) from layer i; config().heads follows.
  void prune_heads(int64_t layer, const std::vector<int64_t>& ids);
  const std::vector<Tensor>& attention_weights() const { return weights_; }

  Linear patch_embed;
  Tensor cls_token, pos_cls, row_embed, col_embed;  // (1, D), (1, D), (grid, D), (grid, D)
  Tensor cls_token_grad, pos_cls_grad, row_embed_grad, col_embed_grad;
  std::vector<std::unique_ptr<TransformerEncoderLayer>> layers;
  LayerNorm norm;
  Linear head;

 private:
  VisionTransformerConfig config_;
  std::vector<Tensor> weights_;
  int64_t batch_ = 0;
};

}  // namespace mha::nn
