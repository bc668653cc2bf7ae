// Layers: values against closed forms, finite-difference gradients of every
// input and parameter in double, modes and errors.
#include <omp.h>

#include <cstdio>

#include "testing.h"

using namespace mha;
using namespace mha::nn;
using namespace mha::testing;

namespace {

// Checks every parameter's gradient and the input's of a layer whose
// forward/backward take and return one tensor, with loss = Σ y∘R.
template <class Layer>
void check_layer_gradients(Layer& layer, Tensor x, const std::string& name) {
  SCOPED_TRACE(name);
  Tensor y = layer.forward(x);
  Tensor r = random_tensor(y.shape(), 99);
  layer.zero_grad();
  Tensor dx = layer.backward(r);
  auto loss = [&] { return weighted_sum(layer.forward(x), r); };
  const double ex = gradient_error(x, dx, loss);
  EXPECT_LT(ex, 1e-6) << "dx";
  double worst = ex;
  for (NamedParameter& p : layer.named_parameters()) {
    const double e = gradient_error(*p.value, *p.grad, loss);
    EXPECT_LT(e, 1e-6) << p.name;
    EXPECT_GT(max_abs(*p.grad), 0.0) << p.name;
    worst = std::max(worst, e);
  }
  std::printf("  %-28s worst relative gradient error %.1e\n", name.c_str(), worst);
}

}  // namespace

TEST(Linear, MatchesDefinitionAndInit) {
  Generator g(1);
  Linear lin({.in_features = 5, .out_features = 3, .dtype = DType::float64}, g);
  EXPECT_LE(max_abs(lin.weight), 1.0 / std::sqrt(5.0));
  EXPECT_LE(max_abs(lin.bias), 1.0 / std::sqrt(5.0));
  Tensor x = random_tensor({2, 4, 5}, 2);
  Tensor y = lin.forward(x);
  EXPECT_EQ(y.shape(), (Shape{2, 4, 3}));
  double want = lin.bias.item({1});
  for (int64_t i = 0; i < 5; ++i) want += x.item({1, 2, i}) * lin.weight.item({1, i});
  EXPECT_NEAR(y.item({1, 2, 1}), want, 1e-14);
  std::vector<std::string> names;
  for (const NamedParameter& p : lin.named_parameters()) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "bias"}));
}

TEST(Linear, Gradients) {
  Generator g(1);
  Linear lin({.in_features = 5, .out_features = 3, .dtype = DType::float64}, g);
  check_layer_gradients(lin, random_tensor({2, 4, 5}, 2), "Linear");
  Linear no_bias({.in_features = 4, .out_features = 6, .bias = false, .dtype = DType::float64}, g);
  check_layer_gradients(no_bias, random_tensor({7, 4}, 3).transpose(0, 1).contiguous().transpose(0, 1), "Linear no bias");
}

TEST(LayerNorm, NormalisesRows) {
  LayerNorm ln({.normalized_shape = 6, .dtype = DType::float64});
  Tensor x = random_tensor({3, 6}, 1, DType::float64, 5.0);
  Tensor y = ln.forward(x);
  for (int64_t r = 0; r < 3; ++r) {
    double mean = 0, var = 0;
    for (int64_t d = 0; d < 6; ++d) mean += y.item({r, d}) / 6;
    for (int64_t d = 0; d < 6; ++d) var += (y.item({r, d}) - mean) * (y.item({r, d}) - mean) / 6;
    EXPECT_NEAR(mean, 0.0, 1e-12);
    EXPECT_NEAR(var, 1.0, 1e-5);  // σ²/(σ² + ε)
  }
}

TEST(LayerNorm, Gradients) {
  LayerNorm ln({.normalized_shape = 7, .dtype = DType::float64});
  // Non-trivial affine parameters so that their gradients and uses are exercised.
  ln.weight.copy_(random_tensor({7}, 5));
  ln.bias.copy_(random_tensor({7}, 6));
  check_layer_gradients(ln, random_tensor({2, 3, 7}, 2), "LayerNorm");
  LayerNorm plain({.normalized_shape = 5, .elementwise_affine = false, .dtype = DType::float64});
  EXPECT_TRUE(plain.named_parameters().empty());
  check_layer_gradients(plain, random_tensor({4, 5}, 3), "LayerNorm without affine");
}

// forward_sum / backward_add (the residual add fused into the norm) against
// the add and the norm done apart, in both dtypes; their errors.
TEST(LayerNorm, FusedResidualAddMatchesSeparate) {
  for (DType dtype : {DType::float64, DType::float32}) {
    LayerNorm fused({.normalized_shape = 9, .dtype = dtype}), apart({.normalized_shape = 9, .dtype = dtype});
    for (LayerNorm* ln : {&fused, &apart}) {
      ln->weight.copy_(random_tensor({9}, 5));
      ln->bias.copy_(random_tensor({9}, 6));
    }
    const Tensor x = random_tensor({2, 3, 9}, 1, dtype), r = random_tensor({2, 3, 9}, 2, dtype);
    const Tensor dy = random_tensor({2, 3, 9}, 3, dtype), g = random_tensor({2, 3, 9}, 4, dtype);
    Tensor sum;
    const Tensor y = fused.forward_sum(x, r, &sum);
    const Tensor h = add(x, r);
    const double tol = dtype == DType::float64 ? 1e-12 : 1e-5;
    EXPECT_EQ(max_abs_diff(sum, h), 0.0);
    EXPECT_LE(max_abs_diff(y, apart.forward(h)), tol);
    EXPECT_LE(max_abs_diff(fused.backward_add(dy, g), add(apart.backward(dy), g)), tol);
    EXPECT_LE(max_abs_diff(fused.weight_grad, apart.weight_grad), tol);
    EXPECT_LE(max_abs_diff(fused.bias_grad, apart.bias_grad), tol);
  }
  LayerNorm ln({.normalized_shape = 4});
  Tensor sum;
  expect_error<StateError>([&] { ln.backward_add(Tensor::zeros({2, 4}), Tensor::zeros({2, 4})); },
                           "[mha::nn::LayerNorm::backward_add] state: expected a forward call first; got none");
  expect_error<ShapeError>([&] { ln.forward_sum(Tensor::zeros({2, 4}), Tensor::zeros({2, 3}), &sum); },
                           "[mha::nn::LayerNorm::forward_sum] residual: expected shape (2, 4); got (2, 3)");
  expect_error<DtypeError>([&] { ln.forward_sum(Tensor::zeros({2, 4}), Tensor::zeros({2, 4}, DType::float64), &sum); },
                           "[mha::nn::LayerNorm::forward_sum] residual: expected float32; got float64");
  ln.forward_sum(Tensor::zeros({2, 4}), Tensor::zeros({2, 4}), &sum);
  expect_error<ShapeError>([&] { ln.backward_add(Tensor::zeros({2, 4}), Tensor::zeros({4, 2})); },
                           "[mha::nn::LayerNorm::backward_add] residual_grad: expected shape (2, 4); got (4, 2)");
}

TEST(Activations, ValuesAndGradients) {
  ReLU relu;
  GELU gelu, gelu_tanh(GELU::Approximate::tanh);
  Tensor x = Tensor::from_values(std::vector<double>{-2, -0.5, 0.5, 1, 3}, {5}, DType::float64);
  EXPECT_EQ(relu.forward(x).to_vector(), (std::vector<double>{0, 0, 0.5, 1, 3}));
  EXPECT_NEAR(gelu.forward(x).item({3}), 0.8413447460685429, 1e-15);     // Φ(1)
  EXPECT_NEAR(gelu_tanh.forward(x).item({3}), 0.8411919906082768, 1e-15);
  Tensor away_from_kink = random_tensor({3, 4}, 1);  // ReLU is not differentiable at 0
  check_layer_gradients(relu, away_from_kink, "ReLU");
  check_layer_gradients(gelu, random_tensor({3, 4}, 2), "GELU");
  check_layer_gradients(gelu_tanh, random_tensor({3, 4}, 3), "GELU tanh");
}

// The bias gradient summed in the activation's sweep: in float32 exactly the
// Linear's own column sums (same blocks, same order), added to what was there;
// in float64 the reference loop's. Linear then leaves its bias gradient alone.
TEST(Activations, BiasGradientInTheBackwardSweep) {
  for (DType dtype : {DType::float32, DType::float64})
    for (bool tanh : {false, true}) {
      SCOPED_TRACE(to_string(dtype) + (tanh ? " tanh" : ""));
      Generator g1(4), g2(4);
      const LinearConfig config{.in_features = 24, .out_features = 40, .dtype = dtype};
      Linear a(config, g1), b(config, g2);
      const GELU::Approximate kind = tanh ? GELU::Approximate::tanh : GELU::Approximate::none;
      GELU act_a(kind), act_b(kind);
      const Tensor x = random_tensor({7, 300, 24}, 5, dtype), r = random_tensor({7, 300, 40}, 6, dtype);
      a.bias_grad.fill_(0.5), b.bias_grad.fill_(0.5);  // added to, not overwritten
      act_a.forward(a.forward(x));
      act_b.forward(b.forward(x));
      const Tensor dxa = a.backward(act_a.backward(r, a.bias_grad), /*bias_grad_added=*/true);
      const Tensor dxb = b.backward(act_b.backward(r));
      EXPECT_EQ(max_abs_diff(a.bias_grad, b.bias_grad), 0.0);
      EXPECT_EQ(max_abs_diff(a.weight_grad, b.weight_grad), 0.0);
      EXPECT_EQ(max_abs_diff(dxa, dxb), 0.0);
    }
  GELU gelu;
  gelu.forward(random_tensor({3, 4}, 1));
  Tensor wrong = Tensor::zeros({5}, DType::float64), wrong_type = Tensor::zeros({4}, DType::float32);
  EXPECT_THROW(gelu.backward(random_tensor({3, 4}, 2), wrong), ShapeError);
  EXPECT_THROW(gelu.backward(random_tensor({3, 4}, 2), wrong_type), DtypeError);
}

TEST(Dropout, TrainingEvaluationAndGradient) {
  Generator g(3);
  Dropout drop(0.3, g);
  Tensor x = Tensor::full({4000}, 1.0, DType::float64);
  Tensor y = drop.forward(x);
  int64_t zeros = 0;
  for (double v : y.to_vector()) {
    if (v == 0) ++zeros;
    else EXPECT_NEAR(v, 1 / 0.7, 1e-15);
  }
  EXPECT_NEAR(double(zeros) / 4000, 0.3, 0.03);
  Tensor dy = random_tensor({4000}, 4);
  Tensor dx = drop.backward(dy);
  for (int64_t i = 0; i < 4000; ++i) EXPECT_EQ(dx.item({i}), y.item({i}) * dy.item({i}));  // same pattern
  EXPECT_GT(max_abs_diff(drop.forward(x), y), 0.0);  // a fresh pattern per call
  drop.eval();
  EXPECT_EQ(drop.forward(x).to_vector(), x.to_vector());
  EXPECT_EQ(drop.backward(dy).to_vector(), dy.to_vector());
  // Passing through, a bf16-mixed operand may be bfloat16; dropping, it may not; integers never.
  const Tensor x16 = Tensor::zeros({8}).to(DType::bfloat16);
  EXPECT_EQ(drop.forward(x16).raw_data(), x16.raw_data());
  EXPECT_THROW(drop.forward(Tensor::zeros({8}, DType::int64)), DtypeError);
  drop.train();
  EXPECT_THROW(drop.forward(x16), DtypeError);
  EXPECT_THROW(drop.forward(Tensor::zeros({8}, DType::int64)), DtypeError);
}

TEST(Layers, Errors) {
  Generator g;
  EXPECT_THROW(Linear({.in_features = 0, .out_features = 2}, g), ValueError);
  EXPECT_THROW(Linear({.in_features = 2, .out_features = 2, .dtype = DType::bfloat16}, g), DtypeError);
  Linear lin({.in_features = 3, .out_features = 2}, g);
  EXPECT_THROW(lin.backward(Tensor::zeros({2})), StateError);
  try {
    lin.forward(Tensor::zeros({4, 5}));
    FAIL();
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("[mha::nn::Linear::forward] x: expected last dim 3; got (4, 5)"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(lin.forward(Tensor::zeros({4, 3}, DType::float64)), DtypeError);
  lin.forward(Tensor::zeros({4, 3}));
  EXPECT_THROW(lin.backward(Tensor::zeros({4, 3})), ShapeError);
  EXPECT_THROW(LayerNorm({.normalized_shape = 4, .eps = 0}), ValueError);
  EXPECT_THROW(Dropout(1.0, g), ValueError);
  LayerNorm ln({.normalized_shape = 4});
  EXPECT_THROW(ln.forward(Tensor::zeros({2, 3})), ShapeError);
}

TEST(Embedding, LookupAndScatterAddGradient) {
  Generator g(1);
  Embedding emb({.num_embeddings = 6, .embedding_dim = 3, .padding_idx = 0, .dtype = DType::float64}, g);
  EXPECT_EQ(max_abs(emb.weight.select(0, 0)), 0.0);
  Tensor ids = Tensor::from_values(std::vector<double>{2, 0, 5, 2}, {2, 2}, DType::int64);
  EXPECT_EQ(ids.dtype(), DType::int64);
  Tensor y = emb.forward(ids);
  EXPECT_EQ(y.shape(), (Shape{2, 2, 3}));
  for (int64_t d = 0; d < 3; ++d) EXPECT_EQ(y.item({1, 1, d}), emb.weight.item({2, d}));
  Tensor dy = random_tensor({2, 2, 3}, 2);
  emb.backward(dy);
  for (int64_t d = 0; d < 3; ++d) {
    EXPECT_NEAR(emb.weight_grad.item({2, d}), dy.item({0, 0, d}) + dy.item({1, 1, d}), 1e-15);  // id 2 twice
    EXPECT_EQ(emb.weight_grad.item({0, d}), 0.0);                                              // padding
    EXPECT_EQ(emb.weight_grad.item({5, d}), dy.item({1, 0, d}));
  }
  // Finite differences on the weight.
  emb.zero_grad();
  emb.forward(ids);
  Tensor r = random_tensor({2, 2, 3}, 3);
  emb.backward(r);
  Tensor grad_without_padding = emb.weight_grad.clone();
  auto loss = [&] { return weighted_sum(emb.forward(ids), r); };
  // The padding row does get a numeric gradient (it is looked up); torch, like mha, reports 0 for it.
  Tensor numeric_target = grad_without_padding.clone();
  for (int64_t d = 0; d < 3; ++d) numeric_target.set_item({0, d}, r.item({0, 1, d}));
  EXPECT_LT(gradient_error(emb.weight, numeric_target, loss), 1e-6);
  EXPECT_THROW(emb.forward(Tensor::from_values(std::vector<double>{6}, {1}, DType::int64)), ValueError);
  EXPECT_THROW(emb.forward(Tensor::zeros({2})), DtypeError);
}

namespace {

// Replays every random stream of an encoder layer, so that repeated forwards
// draw the same dropout patterns (finite differences need a fixed function).
struct DropoutReplay {
  std::vector<std::pair<Generator*, std::pair<uint64_t, uint64_t>>> saved;
  explicit DropoutReplay(std::initializer_list<Generator*> generators) {
    for (Generator* g : generators) saved.push_back({g, {g->seed(), g->offset()}});
  }
  explicit DropoutReplay(TransformerEncoderLayer& l)
      : DropoutReplay({&l.self_attn.dropout_generator(), &l.dropout.generator(), &l.dropout1.generator(),
                       &l.dropout2.generator()}) {}
  explicit DropoutReplay(TransformerDecoderLayer& l)
      : DropoutReplay({&l.self_attn.dropout_generator(), &l.multihead_attn.dropout_generator(), &l.dropout.generator(),
                       &l.dropout1.generator(), &l.dropout2.generator(), &l.dropout3.generator()}) {}
  void rewind() {
    for (auto& [g, state] : saved) g->set_state(state.first, state.second);
  }
};

}  // namespace

TEST(TransformerEncoderLayer, ParameterNamesAsTorch) {
  Generator g(1);
  TransformerEncoderLayer layer({.d_model = 8, .nhead = 2, .dim_feedforward = 16}, g);
  std::vector<std::string> names;
  for (const NamedParameter& p : layer.named_parameters()) names.push_back(p.name + shape_string(p.value->shape()));
  EXPECT_EQ(names, (std::vector<std::string>{"self_attn.in_proj_weight(24, 8)", "self_attn.in_proj_bias(24,)",
                                             "self_attn.out_proj.weight(8, 8)", "self_attn.out_proj.bias(8,)",
                                             "linear1.weight(16, 8)", "linear1.bias(16,)", "linear2.weight(8, 16)",
                                             "linear2.bias(8,)", "norm1.weight(8,)", "norm1.bias(8,)", "norm2.weight(8,)",
                                             "norm2.bias(8,)"}));
}

TEST(TransformerEncoderLayer, GradientsPostAndPreLN) {
  for (bool norm_first : {false, true})
    for (Activation act : {Activation::relu, Activation::gelu})
      for (double p : {0.0, 0.2}) {
        Generator g(4);
        TransformerEncoderLayer layer({.d_model = 6, .nhead = 2, .dim_feedforward = 10, .dropout = p, .activation = act,
                                       .batch_first = norm_first, .norm_first = norm_first, .dtype = DType::float64},
                                      g);
        for (NamedParameter& prm : layer.named_parameters())  // non-trivial biases and norms
          if (prm.name.find("bias") != std::string::npos || prm.name.find("norm") != std::string::npos)
            prm.value->copy_(random_tensor(prm.value->shape(), 50 + prm.name.size(), DType::float64, 0.5));
        Tensor x = random_tensor(norm_first ? Shape{2, 5, 6} : Shape{5, 2, 6}, 7);
        Tensor kpm = Tensor::from_bools({false, false, false, true, false, false, false, false, false, true}, {2, 5});
        const EncoderInputs in{.src_key_padding_mask = kpm, .is_causal = !norm_first};
        DropoutReplay replay(layer);
        Tensor r = random_tensor(x.shape(), 8);
        layer.zero_grad();
        replay.rewind();
        layer.forward(x, in);
        Tensor dx = layer.backward(r);
        auto loss = [&] {
          replay.rewind();
          return weighted_sum(layer.forward(x, in), r);
        };
        const std::string name = std::string(norm_first ? "Pre-LN" : "Post-LN") + (act == Activation::relu ? " relu" : " gelu") +
                                 (p > 0 ? " dropout" : "");
        SCOPED_TRACE(name);
        double worst = gradient_error(x, dx, loss);
        EXPECT_LT(worst, 1e-6) << "dx";
        for (NamedParameter& prm : layer.named_parameters()) {
          const double e = gradient_error(*prm.value, *prm.grad, loss);
          EXPECT_LT(e, 1e-6) << prm.name;
          worst = std::max(worst, e);
        }
        std::printf("  encoder layer %-24s worst relative gradient error %.1e\n", name.c_str(), worst);
      }
}

TEST(TransformerEncoderLayer, EvalIsDeterministicAndMatchesComposition) {
  Generator g(2);
  TransformerEncoderLayer layer({.d_model = 8, .nhead = 2, .dim_feedforward = 12, .dropout = 0.3, .dtype = DType::float64}, g);
  layer.eval();
  Tensor x = random_tensor({4, 3, 8}, 1);
  Tensor y = layer.forward(x);
  EXPECT_EQ(max_abs_diff(y, layer.forward(x)), 0.0);
  // Post-LN by hand from the same sub-modules.
  Tensor sa = layer.self_attn.forward(x, x, x, {.need_weights = false}).output;
  Tensor h = layer.norm1.forward(add(x, sa));
  ReLU relu;
  Tensor ff = layer.linear2.forward(relu.forward(layer.linear1.forward(h)));
  EXPECT_LE(max_abs_diff(y, layer.norm2.forward(add(h, ff))), 1e-14);
  layer.train();
  EXPECT_GT(max_abs_diff(layer.forward(x), y), 1e-6);  // dropout on again
}

TEST(TransformerDecoderLayer, ParameterNamesAsTorch) {
  Generator g(1);
  TransformerDecoderLayer layer({.d_model = 4, .nhead = 2, .dim_feedforward = 8}, g);
  std::vector<std::string> names;
  for (const NamedParameter& p : layer.named_parameters()) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{
                       "self_attn.in_proj_weight", "self_attn.in_proj_bias", "self_attn.out_proj.weight",
                       "self_attn.out_proj.bias", "multihead_attn.in_proj_weight", "multihead_attn.in_proj_bias",
                       "multihead_attn.out_proj.weight", "multihead_attn.out_proj.bias", "linear1.weight", "linear1.bias",
                       "linear2.weight", "linear2.bias", "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias",
                       "norm3.weight", "norm3.bias"}));
}

TEST(TransformerDecoderLayer, GradientsOfTargetMemoryAndParameters) {
  for (bool norm_first : {false, true})
    for (double p : {0.0, 0.25}) {
      Generator g(6);
      TransformerDecoderLayer layer({.d_model = 6, .nhead = 3, .dim_feedforward = 8, .dropout = p,
                                     .activation = norm_first ? Activation::gelu : Activation::relu,
                                     .batch_first = true, .norm_first = norm_first, .dtype = DType::float64},
                                    g);
      for (NamedParameter& prm : layer.named_parameters())
        if (prm.name.find("bias") != std::string::npos || prm.name.find("norm") != std::string::npos)
          prm.value->copy_(random_tensor(prm.value->shape(), 70 + prm.name.size(), DType::float64, 0.5));
      Tensor tgt = random_tensor({2, 4, 6}, 1), memory = random_tensor({2, 5, 6}, 2);
      Tensor mkpm = Tensor::from_bools({false, false, true, false, false, false, false, false, false, true}, {2, 5});
      const DecoderInputs in{.memory_key_padding_mask = mkpm, .tgt_is_causal = true};
      DropoutReplay replay(layer);
      Tensor r = random_tensor(tgt.shape(), 3);
      layer.zero_grad();
      replay.rewind();
      layer.forward(tgt, memory, in);
      DecoderGradients d = layer.backward(r);
      auto loss = [&] {
        replay.rewind();
        return weighted_sum(layer.forward(tgt, memory, in), r);
      };
      const std::string name = std::string(norm_first ? "Pre-LN" : "Post-LN") + (p > 0 ? " dropout" : "");
      SCOPED_TRACE(name);
      double worst = std::max(gradient_error(tgt, d.dtgt, loss), gradient_error(memory, d.dmemory, loss));
      EXPECT_LT(worst, 1e-6) << "dtgt/dmemory";
      for (NamedParameter& prm : layer.named_parameters()) {
        const double e = gradient_error(*prm.value, *prm.grad, loss);
        EXPECT_LT(e, 1e-6) << prm.name;
        worst = std::max(worst, e);
      }
      std::printf("  decoder layer %-24s worst relative gradient error %.1e\n", name.c_str(), worst);
    }
}

// At sizes that split the work over threads: the embedding's scatter-add by
// column blocks and the sinusoidal add by rows give, on one thread and on
// two, exactly what plain loops give (every sum in row order).
TEST(Embedding, ScatterAddAndPositionsOnThreadsAsPlainLoops) {
  const int64_t V = 37, D = 200, N = 3, L = 211;
  Tensor ids = Tensor::empty({N, L}, DType::int64);
  for (int64_t i = 0; i < N * L; ++i) ids.data<int64_t>()[i] = (i * 7 + i / 5) % V;
  const Tensor dy = random_tensor({N, L, D}, 4, DType::float32);
  std::vector<float> want(size_t(V * D), 0.0f);
  for (int64_t i = 0; i < N * L; ++i) {
    const int64_t id = ids.data<int64_t>()[i];
    if (id == 3) continue;  // padding
    for (int64_t d = 0; d < D; ++d) want[size_t(id * D + d)] += dy.data<float>()[i * D + d];
  }
  const Tensor x = random_tensor({N, L, D}, 5, DType::float32);
  const Tensor pe = sinusoidal_encoding(L, D, DType::float32, 9);
  const int before = omp_get_max_threads();
  for (int threads : {1, 2}) {
    SCOPED_TRACE(std::to_string(threads) + " threads");
    omp_set_num_threads(threads);
    Generator g(1);
    Embedding emb({.num_embeddings = V, .embedding_dim = D, .padding_idx = 3, .dtype = DType::float32}, g);
    emb.forward(ids);
    emb.backward(dy);
    for (int64_t x_ = 0; x_ < V * D; ++x_) ASSERT_EQ(emb.weight_grad.data<float>()[x_], want[size_t(x_)]) << x_;
    const Tensor y = add_sinusoidal_encoding(x, true, 9);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t d = 0; d < D; d += 13)
          ASSERT_EQ(y.item({n, l, d}), double(float(x.item({n, l, d}) + pe.item({l, d}))));
  }
  omp_set_num_threads(before);
}

TEST(Positional, SinusoidalAsDefined) {
  Tensor pe = sinusoidal_encoding(50, 8, DType::float64);
  EXPECT_EQ(pe.item({0, 0}), 0.0);
  EXPECT_EQ(pe.item({0, 1}), 1.0);
  EXPECT_NEAR(pe.item({7, 2}), std::sin(7 / std::pow(10000.0, 2.0 / 8)), 1e-15);
  EXPECT_NEAR(pe.item({7, 3}), std::cos(7 / std::pow(10000.0, 2.0 / 8)), 1e-15);
  // Works past any training length, and offsets continue the same table.
  Tensor later = sinusoidal_encoding(10, 8, DType::float64, 45);
  EXPECT_LE(max_abs_diff(later.slice(0, 0, 5), pe.slice(0, 45, 50)), 1e-15);
  Tensor x = random_tensor({3, 2, 8}, 1);
  Tensor y = add_sinusoidal_encoding(x);
  EXPECT_NEAR(y.item({2, 1, 3}), x.item({2, 1, 3}) + pe.item({2, 3}), 1e-15);
  Tensor yb = add_sinusoidal_encoding(x.transpose(0, 1).contiguous(), true);
  EXPECT_LE(max_abs_diff(yb.transpose(0, 1), y), 1e-15);
  EXPECT_THROW(sinusoidal_encoding(0, 8), ValueError);
  // The table is computed once per width and grown on demand: rows far past
  // it follow the formula, the rows before stay as they were, and writing to
  // a returned table leaves the next one alone.
  Tensor far = sinusoidal_encoding(3, 8, DType::float64, 1000);
  EXPECT_EQ(far.item({2, 4}), std::sin(1002.0 * std::pow(10000.0, -4.0 / 8)));
  EXPECT_EQ(far.item({1, 7}), std::cos(1001.0 * std::pow(10000.0, -6.0 / 8)));
  pe.fill_(7.0);
  Tensor again = sinusoidal_encoding(50, 8, DType::float64);
  EXPECT_EQ(again.item({7, 3}), std::cos(7.0 * std::pow(10000.0, -2.0 / 8)));
  EXPECT_EQ(sinusoidal_encoding(4, 8, DType::float32).item({3, 0}), double(float(std::sin(3.0))));
}
