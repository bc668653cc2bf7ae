// Every bad input raises a typed error, before any work, whose message names
// the function, the argument, what was expected and what came.
#include "mha/viz/html.h"
#include "mha/viz/image.h"
#include "testing.h"

using namespace mha;
using namespace mha::testing;

namespace {

Tensor t(const Shape& s, DType d = DType::float32) { return Tensor::zeros(s, d); }

}  // namespace

TEST(Errors, TypesDeriveFromStandardOnes) {
  static_assert(std::is_base_of_v<std::invalid_argument, ShapeError>);
  static_assert(std::is_base_of_v<std::invalid_argument, DtypeError>);
  static_assert(std::is_base_of_v<std::invalid_argument, ValueError>);
  static_assert(std::is_base_of_v<std::runtime_error, DeviceError>);
  static_assert(std::is_base_of_v<std::logic_error, StateError>);
  static_assert(std::is_base_of_v<std::runtime_error, NumericalError>);
  static_assert(std::is_base_of_v<std::runtime_error, MemoryError>);
}

// Too large a tensor is refused before anything is allocated: a byte count
// that overflows, more than the machine has, more than the limit set.
TEST(Errors, MemoryLimits) {
  expect_error<MemoryError>([] { Tensor::empty({int64_t(1) << 40, int64_t(1) << 40}); },
                            {"[mha::Tensor::empty] shape (1099511627776, 1099511627776) of float32", "2^63 bytes"});
  expect_error<MemoryError>([] { Tensor::empty({int64_t(1) << 30, int64_t(1) << 14}); },
                            {"the machine's memory", "got 64 TiB"});
  EXPECT_GT(memory_limit(), int64_t(1) << 20);
  const int64_t machine = memory_limit();
  set_memory_limit(int64_t(1) << 20);  // 1 MiB of tensors
  EXPECT_EQ(memory_limit(), int64_t(1) << 20);
  const Tensor q = t({1, 1, 600, 4}), kv = t({1, 1, 600, 4});
  EXPECT_NO_THROW(attention_forward(q, kv, kv));
  // The weights, 600 × 600 floats (1.4 MB), do not fit: refused before the kernel runs.
  expect_error<MemoryError>([&] { attention_forward(q, kv, kv, {.return_weights = true}); },
                            {"shape (1, 1, 600, 600) of float32", "the limit 1 MiB set by set_memory_limit", "got 1.37 MiB"});
  Generator g(1);
  nn::Linear layer({.in_features = 4, .out_features = 512}, g);
  expect_error<MemoryError>([&] { layer.forward(t({600, 4})); }, "shape (600, 512)");
  set_memory_limit(0);
  EXPECT_EQ(memory_limit(), machine);
  EXPECT_NO_THROW(attention_forward(q, kv, kv, {.return_weights = true}));
  expect_error<ValueError>([] { set_memory_limit(-1); }, "[mha::set_memory_limit] bytes: expected >= 0");
}

TEST(Errors, AttentionArguments) {
  const char* fn = "[mha::attention_forward]";
  Tensor q = t({2, 6, 5, 4}), k = t({2, 6, 7, 4}), v = t({2, 6, 7, 3});
  expect_error<ShapeError>([&] { attention_forward(Tensor(), k, v); }, {fn, "query", "expected a defined tensor", "undefined"});
  expect_error<DtypeError>([&] { attention_forward(q, k.to(DType::float64), v); }, {fn, "key", "float32", "got float64"});
  expect_error<DtypeError>([&] { attention_forward(q.to(DType::boolean), k, v); }, {fn, "query", "got bool"});
  expect_error<ShapeError>([&] { attention_forward(t({4}), k, v); }, {fn, "query", "at least 2 dims", "got (4,)"});
  expect_error<ShapeError>([&] { attention_forward(t({2, 6, 0, 4}), k, v); }, {fn, "query", "non-empty", "(2, 6, 0, 4)"});
  expect_error<ShapeError>([&] { attention_forward(q, t({2, 6, 7, 5}), v); }, {fn, "key", "last dim E = 4", "(2, 6, 7, 5)"});
  expect_error<ShapeError>([&] { attention_forward(q, k, t({2, 6, 8, 3})); }, {fn, "value", "S = 7", "(2, 6, 8, 3)"});
  expect_error<ShapeError>([&] { attention_forward(q, t({2, 4, 7, 4}), t({2, 4, 7, 3})); },
                           {fn, "key has 4 heads; query has 6, which 4 does not divide"});
  expect_error<ShapeError>([&] { attention_forward(t({3, 6, 5, 4}), k, v); }, {fn, "key", "broadcast", "dim -4: 2 vs 3"});
  expect_error<ShapeError>([&] { attention_forward(q, k, t({2, 3, 7, 3})); }, {fn, "value", "broadcast with key"});
  expect_error<ShapeError>([&] { attention_forward(q, k, v, {.mask = t({5, 6})}); },
                           {fn, "mask", "(…, L, S) = (2, 6, 5, 7)", "got (5, 6)"});
  expect_error<ShapeError>([&] { attention_forward(q, k, v, {.mask = t({1, 2, 6, 5, 7})}); }, {fn, "mask"});
  Tensor nan_mask = t({5, 7});
  nan_mask.set_item({1, 2}, NAN);
  expect_error<ValueError>([&] { attention_forward(q, k, v, {.mask = nan_mask}); }, {fn, "mask", "finite values or -inf", "NaN"});
  nan_mask.set_item({1, 2}, INFINITY);
  expect_error<ValueError>([&] { attention_forward(q, k, v, {.mask = nan_mask}); }, {fn, "mask", "+inf"});
  for (double p : {1.0, -0.1, double(NAN)})
    expect_error<ValueError>([&] { attention_forward(q, k, v, {.dropout_p = p}); }, {fn, "dropout_p", "[0, 1)"});
  for (double s : {double(INFINITY), double(NAN)})
    expect_error<ValueError>([&] { attention_forward(q, k, v, {.scale = s}); }, {fn, "scale", "finite"});
  // Found by fuzz_attention: a scale finite in double but not in float32 made every logit infinite.
  expect_error<ValueError>([&] { attention_forward(q, k, v, {.scale = -1e300}); },
                           {fn, "scale: expected a number finite in float32 (the compute dtype of float32 inputs)"});
  EXPECT_NO_THROW(attention_forward(q.to(DType::float64), k.to(DType::float64), v.to(DType::float64), {.scale = -1e300}));
}

TEST(Errors, AttentionBackwardArguments) {
  const char* fn = "[mha::attention_backward]";
  Tensor q = random_tensor({2, 5, 4}, 1, DType::float32), k = random_tensor({2, 7, 4}, 2, DType::float32),
         v = random_tensor({2, 7, 3}, 3, DType::float32);
  Generator g(1);
  AttentionOptions o{.mask = rand_bool({5, 7}, g, 0.5)};
  AttentionOutput f = attention_forward(q, k, v, o);
  Tensor dout = t({2, 5, 3});
  expect_error<ShapeError>([&] { attention_backward(t({2, 5, 4}), q, k, v, f, o); }, {fn, "dout", "(2, 5, 3)", "(2, 5, 4)"});
  expect_error<DtypeError>([&] { attention_backward(dout.to(DType::float64), q, k, v, f, o); }, {fn, "dout", "got float64"});
  expect_error<ValueError>([&] { attention_backward(dout, q, k, v, f, o, true); }, {fn, "mask_grad", "floating", "a bool mask"});
  expect_error<ValueError>([&] { attention_backward(dout, q, k, v, f, {}, true); }, {fn, "mask_grad", "no mask"});
  AttentionOutput bad = f;
  bad.lse = t({2, 4});
  expect_error<ShapeError>([&] { attention_backward(dout, q, k, v, bad, o); }, {fn, "forward.lse", "(2, 5)"});
  bad = f;
  bad.out = Tensor();
  expect_error<ShapeError>([&] { attention_backward(dout, q, k, v, bad, o); }, {fn, "forward.out", "defined"});
}

TEST(Errors, CudaIsNotBuilt) {
  expect_error<DeviceError>([] { Tensor::zeros({2}, DType::float32, Device::cuda); },
                            {"[mha::Tensor::empty]", "not built with CUDA"});
}

TEST(Errors, MultiheadAttentionConfig) {
  const char* fn = "[mha::nn::MultiheadAttention]";
  Generator g;
  expect_error<ValueError>([&] { nn::MultiheadAttention({.embed_dim = 10, .num_heads = 3}, g); },
                           {fn, "embed_dim", "a multiple of num_heads = 3", "got 10"});
  expect_error<ValueError>([&] { nn::MultiheadAttention({.embed_dim = 0}, g); }, {fn, "embed_dim", "> 0"});
  expect_error<ValueError>([&] { nn::MultiheadAttention({.embed_dim = 4, .num_heads = 0}, g); }, {fn, "num_heads"});
  expect_error<ValueError>([&] { nn::MultiheadAttention({.embed_dim = 4, .dropout = 1.0}, g); }, {fn, "dropout", "[0, 1)"});
  expect_error<ValueError>([&] { nn::MultiheadAttention({.embed_dim = 4, .kdim = -1}, g); }, {fn, "kdim"});
  expect_error<DtypeError>([&] { nn::MultiheadAttention({.embed_dim = 4, .dtype = DType::bfloat16}, g); },
                           {fn, "dtype", "float32 or float64", "bfloat16"});
}

TEST(Errors, MultiheadAttentionForwardAndBackward) {
  const char* fn = "[mha::nn::MultiheadAttention::forward]";
  Generator g;
  nn::MultiheadAttention m({.embed_dim = 4, .num_heads = 2, .kdim = 3}, g);
  Tensor q = t({5, 2, 4}), k = t({6, 2, 3}), v = t({6, 2, 4});
  expect_error<StateError>([&] { m.backward(q); }, {"[mha::nn::MultiheadAttention::backward]", "forward call first"});
  expect_error<ShapeError>([&] { m.forward(t({5, 2, 5}), k, v); }, {fn, "query", "embed_dim = 4", "(5, 2, 5)"});
  expect_error<ShapeError>([&] { m.forward(q, t({6, 2, 4}), v); }, {fn, "key", "kdim = 3"});
  expect_error<ShapeError>([&] { m.forward(q, t({6, 3, 3}), t({6, 3, 4})); }, {fn, "key", "batch size 2"});
  expect_error<ShapeError>([&] { m.forward(q, k, t({7, 2, 4})); }, {fn, "value", "sequence length 6"});
  expect_error<ShapeError>([&] { m.forward(t({2, 4}), k, v); }, {fn, "key", "2 dims, like query"});
  expect_error<ShapeError>([&] { m.forward(t({5, 2, 3, 4}), k, v); }, {fn, "query", "(L, N, D)"});
  expect_error<DtypeError>([&] { m.forward(q.to(DType::float64), k, v); }, {fn, "query", "float32 (the module's dtype)", "float64"});
  expect_error<ShapeError>([&] { m.forward(q, k, v, {.attn_mask = t({5, 5})}); }, {fn, "attn_mask", "(5, 6)", "(4, 5, 6)", "got (5, 5)"});
  expect_error<ShapeError>([&] { m.forward(q, k, v, {.key_padding_mask = t({6, 2})}); }, {fn, "key_padding_mask", "(2, 6)"});
  m.forward(q, k, v);
  expect_error<ShapeError>([&] { m.backward(t({5, 2, 3})); }, {"[mha::nn::MultiheadAttention::backward]", "doutput", "(5, 2, 4)"});
  m.out_proj_weight = t({4, 4}, DType::float64);
  expect_error<StateError>([&] { m.forward(q, k, v); }, {fn, "out_proj.weight", "float32"});
}

TEST(Errors, TensorArguments) {
  Tensor x = t({2, 3});
  expect_error<ShapeError>([&] { x.transpose(0, 1).view({6}); }, {"[mha::Tensor::view]", "contiguous"});
  expect_error<ShapeError>([&] { x.view({4, 2}); }, {"[mha::Tensor::view]", "6 elements"});
  expect_error<ShapeError>([&] { Tensor::from_values(std::vector<double>{1, 2}, {3}); }, {"[mha::Tensor::from_values]", "3", "got 2"});
  expect_error<ShapeError>([&] { x.expand({4, 3}); }, {"[mha::Tensor::expand]", "(2, 3)", "(4, 3)"});
  expect_error<ValueError>([&] { x.slice(0, 0, 1, 0); }, {"[mha::Tensor::slice]", "step"});
  expect_error<ShapeError>([&] { x.item({2, 0}); }, {"[mha::Tensor::item]", "out of range"});
  expect_error<ShapeError>([&] { x.size(2); }, {"[mha::Tensor::size]", "dim", "got 2"});
  expect_error<ShapeError>([&] { Tensor::empty({-1}); }, {"[mha::Tensor::empty]", ">= 0"});
  expect_error<ShapeError>([&] { x.copy_(t({3, 2})); }, {"[mha::Tensor::copy_]", "(2, 3)"});
  Generator g;
  expect_error<DtypeError>([&] { randn({2}, g, 0, 1, DType::boolean); }, {"[mha::randn]", "floating"});
  expect_error<ValueError>([&] { rand_uniform({2}, g, 1, 0); }, {"[mha::rand_uniform]", "low <= high"});
}

TEST(Errors, AttentionPictures) {
  const std::vector<Tensor> weights{t({2, 3, 4})};
  const std::vector<std::string> three{"a", "b", "c"}, four{"a", "b", "c", "d"};
  const char* fn = "[mha::viz::attention_html]";
  expect_error<ShapeError>([&] { viz::attention_html({}, three, four); }, {fn, "weights: expected at least one layer"});
  expect_error<ShapeError>([&] { viz::attention_html(weights, {}, four); }, {fn, "query_tokens: expected at least one token"});
  expect_error<ShapeError>([&] { viz::attention_html(weights, three, {}); }, {fn, "key_tokens: expected at least one token"});
  expect_error<ShapeError>([&] { viz::attention_html(weights, four, three); },
                           {fn, "weights: expected (H, L, S) per layer", "L = 4 query tokens and S = 3 key tokens",
                            "got float32 tensor of shape (2, 3, 4)"});
  expect_error<ShapeError>([&] { viz::attention_html({t({2, 3, 4}), t({1, 3, 4})}, three, four); }, {fn, "(1, 3, 4)"});
  expect_error<ShapeError>([&] { viz::attention_html({t({0, 3, 4})}, three, four); }, {fn, "H ≥ 1"});
  expect_error<ShapeError>([&] { viz::attention_grid(weights, three); },
                           {"[mha::viz::attention_grid] weights:", "L = 3 query tokens and S = 3 key tokens"});
}
