// The README's example, compiled and run by the test suite.
#include <mha/mha.h>

#include <iostream>

int main() {
  mha::Generator gen(0);
  // Attention on [B, H, L, E] tensors: 8 query heads share 2 key/value heads.
  mha::Tensor q = mha::randn({2, 8, 128, 64}, gen);
  mha::Tensor k = mha::randn({2, 2, 128, 64}, gen);
  mha::Tensor v = mha::randn({2, 2, 128, 64}, gen);
  mha::AttentionOptions options{.causal = mha::Causal::top_left, .return_weights = true};
  mha::AttentionOutput fwd = mha::attention_forward(q, k, v, options);
  mha::Tensor dout = mha::randn(fwd.out.shape(), gen);
  mha::AttentionGradients grads = mha::attention_backward(dout, q, k, v, fwd, options);
  std::cout << "out " << mha::shape_string(fwd.out.shape()) << ", weights " << mha::shape_string(fwd.weights.shape())
            << ", dkey " << mha::shape_string(grads.dkey.shape()) << "\n";

  // A torch-style layer: (N, L, D) with batch_first; true in key_padding_mask = padding.
  mha::nn::MultiheadAttention attention({.embed_dim = 64, .num_heads = 4, .batch_first = true}, gen);
  mha::Tensor x = mha::randn({2, 10, 64}, gen);
  std::vector<bool> pad(2 * 10, false);
  pad[19] = true;  // the last token of the second sequence is padding
  mha::Tensor padding = mha::Tensor::from_bools(pad, {2, 10});
  auto [y, weights] = attention.forward(x, x, x, {.key_padding_mask = padding});
  auto input_grads = attention.backward(mha::randn(y.shape(), gen));  // parameter grads accumulate
  std::cout << "y " << mha::shape_string(y.shape()) << ", weights " << mha::shape_string(weights.shape())
            << ", dquery " << mha::shape_string(input_grads.dquery.shape()) << "\n";
  try {
    mha::Tensor k3 = mha::randn({2, 3, 128, 64}, gen);  // 3 heads do not divide 8
    mha::attention_forward(q, k3, k3);
  } catch (const mha::ShapeError& e) {
    std::cout << "error: " << e.what() << "\n";
  }
}
