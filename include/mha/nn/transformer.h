// Transformer layers with the semantics and parameter names of
// torch.nn.TransformerEncoderLayer.
//
// Post-LN (norm_first = false, the original Transformer):
//   x = norm1(x + dropout1(self_attn(x)))
//   x = norm2(x + dropout2(linear2(dropout(activation(linear1(x))))))
// Pre-LN (norm_first = true):
//   x = x + dropout1(self_attn(norm1(x)))
//   x = x + dropout2(linear2(dropout(activation(linear1(norm2(x))))))
// src (S, N, D), or (N, S, D) with batch_first, or unbatched (S, D).
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
};

struct EncoderInputs {
  Tensor src_mask;              // attn_mask of self_attn: (S, S) or (N·H, S, S)
  Tensor src_key_padding_mask;  // (N, S) or (S)
  bool is_causal = false;
};

class TransformerEncoderLayer : public Module {
 public:
  TransformerEncoderLayer(const TransformerEncoderLayerConfig& config, Generator& gen);

  const TransformerEncoderLayerConfig& config() const { return config_; }
  // self_attn.*, linear1.*, linear2.*, norm1.*, norm2.* (torch's order).
  std::vector<NamedParameter> named_parameters() override;
  void train(bool on = true) override;

  Tensor forward(const Tensor& src, const EncoderInputs& inputs = {});
  Tensor backward(const Tensor& dy);

  MultiheadAttention self_attn;
  Linear linear1, linear2;
  LayerNorm norm1, norm2;
  Dropout dropout, dropout1, dropout2;

 private:
  TransformerEncoderLayerConfig config_;
  ReLU relu_;
  GELU gelu_;
  bool forwarded_ = false;

  Tensor self_attention_block(const Tensor& x, const EncoderInputs& inputs);
  Tensor self_attention_block_backward(const Tensor& dy);
  Tensor feed_forward_block(const Tensor& x);
  Tensor feed_forward_block_backward(const Tensor& dy);
};

// a + b, element-wise, same shape and dtype (the residual connections).
Tensor add(const Tensor& a, const Tensor& b);

}  // namespace mha::nn
