// MultiheadAttention against a plain re-derivation of torch's algorithm in
// double, finite-difference checks of every gradient, and its modes.
#include <cstdio>

#include "testing.h"

using namespace mha;
using namespace mha::nn;
using namespace mha::testing;

namespace {

// Row-major matrix product helper on std::vector<double>.
using Mat = std::vector<std::vector<double>>;

Mat linear(const Mat& x, const Tensor& w, int64_t w_row0, const Tensor& b, int64_t b0, int64_t out) {
  Mat y(x.size(), std::vector<double>(size_t(out), 0.0));
  for (size_t r = 0; r < x.size(); ++r)
    for (int64_t o = 0; o < out; ++o) {
      double acc = b.defined() ? b.item({b0 + o}) : 0.0;
      for (size_t i = 0; i < x[r].size(); ++i) acc += x[r][i] * w.item({w_row0 + o, int64_t(i)});
      y[r][size_t(o)] = acc;
    }
  return y;
}

// Sequence n of a (L, N, X) / (N, L, X) / (L, X) tensor as rows.
Mat rows_of(const Tensor& t, int64_t n, bool batch_first) {
  const bool batched = t.dim() == 3;
  const int64_t L = batched ? (batch_first ? t.size(1) : t.size(0)) : t.size(0), X = t.size(-1);
  Mat m(static_cast<size_t>(L), std::vector<double>(static_cast<size_t>(X)));
  for (int64_t l = 0; l < L; ++l)
    for (int64_t x = 0; x < X; ++x)
      m[size_t(l)][size_t(x)] = batched ? (batch_first ? t.item({n, l, x}) : t.item({l, n, x})) : t.item({l, x});
  return m;
}

struct Manual {
  Tensor output, weights;  // weights (N, H, L, S_total), float64
};

// torch.nn.functional.multi_head_attention_forward, written out in loops.
Manual manual_mha(MultiheadAttention& m, const Tensor& query, const Tensor& key, const Tensor& value,
                  const MultiheadAttentionInputs& in) {
  const auto& c = m.config();
  const int64_t D = c.embed_dim, H = c.num_heads, hd = D / H;
  const bool batched = query.dim() == 3;
  const int64_t N = batched ? (c.batch_first ? query.size(0) : query.size(1)) : 1;
  const int64_t L = batched ? (c.batch_first ? query.size(1) : query.size(0)) : query.size(0);
  const int64_t S = batched ? (c.batch_first ? key.size(1) : key.size(0)) : key.size(0);
  const int64_t St = S + c.add_bias_kv + c.add_zero_attn;
  Manual r{Tensor::zeros(query.shape(), DType::float64), Tensor::zeros({N, H, L, St}, DType::float64)};
  const Tensor& wq = m.packed_in_proj() ? m.in_proj_weight : m.q_proj_weight;
  const Tensor& wk = m.packed_in_proj() ? m.in_proj_weight : m.k_proj_weight;
  const Tensor& wv = m.packed_in_proj() ? m.in_proj_weight : m.v_proj_weight;
  const int64_t k0 = m.packed_in_proj() ? D : 0, v0 = m.packed_in_proj() ? 2 * D : 0;
  for (int64_t n = 0; n < N; ++n) {
    Mat q = linear(rows_of(query, n, c.batch_first), wq, 0, m.in_proj_bias, 0, D);
    Mat k = linear(rows_of(key, n, c.batch_first), wk, k0, m.in_proj_bias, D, D);
    Mat v = linear(rows_of(value, n, c.batch_first), wv, v0, m.in_proj_bias, 2 * D, D);
    if (c.add_bias_kv) {
      k.push_back(std::vector<double>(size_t(D)));
      v.push_back(std::vector<double>(size_t(D)));
      for (int64_t e = 0; e < D; ++e) k.back()[size_t(e)] = m.bias_k.item({0, 0, e}), v.back()[size_t(e)] = m.bias_v.item({0, 0, e});
    }
    if (c.add_zero_attn) {
      k.push_back(std::vector<double>(size_t(D), 0.0));
      v.push_back(std::vector<double>(size_t(D), 0.0));
    }
    Mat heads(size_t(L), std::vector<double>(size_t(D), 0.0));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i) {
        std::vector<double> s(static_cast<size_t>(St));
        double max = -INFINITY;
        for (int64_t j = 0; j < St; ++j) {
          double x = 0;
          for (int64_t e = 0; e < hd; ++e) x += q[size_t(i)][size_t(h * hd + e)] * k[size_t(j)][size_t(h * hd + e)];
          x /= std::sqrt(double(hd));
          if (j < S && in.attn_mask.defined()) {
            const double a = in.attn_mask.dim() == 2 ? in.attn_mask.item({i, j}) : in.attn_mask.item({n * H + h, i, j});
            x += in.attn_mask.dtype() == DType::boolean ? (a != 0 ? -INFINITY : 0.0) : a;
          }
          if (j < S && in.key_padding_mask.defined()) {
            const double a = batched ? in.key_padding_mask.item({n, j}) : in.key_padding_mask.item({j});
            x += in.key_padding_mask.dtype() == DType::boolean ? (a != 0 ? -INFINITY : 0.0) : a;
          }
          if (in.is_causal && j > i) x = -INFINITY;
          s[size_t(j)] = x;
          max = std::max(max, x);
        }
        if (max == -INFINITY) continue;  // fully masked: zeros (torch gives NaN)
        double sum = 0;
        for (double x : s) sum += std::exp(x - max);
        for (int64_t j = 0; j < St; ++j) {
          const double p = std::exp(s[size_t(j)] - max) / sum;
          r.weights.set_item({n, h, i, j}, p);
          for (int64_t e = 0; e < hd; ++e) heads[size_t(i)][size_t(h * hd + e)] += p * v[size_t(j)][size_t(h * hd + e)];
        }
      }
    Mat y = linear(heads, m.out_proj_weight, 0, m.out_proj_bias, 0, D);
    for (int64_t l = 0; l < L; ++l)
      for (int64_t e = 0; e < D; ++e) {
        if (!batched) r.output.set_item({l, e}, y[size_t(l)][size_t(e)]);
        else if (c.batch_first) r.output.set_item({n, l, e}, y[size_t(l)][size_t(e)]);
        else r.output.set_item({l, n, e}, y[size_t(l)][size_t(e)]);
      }
  }
  return r;
}

struct MhaCase {
  std::string name;
  MultiheadAttentionConfig config;
  int64_t N = 2, L = 5, S = 4;
  bool unbatched = false;
  std::string masks;  // any of: kpm-bool kpm-float attn-bool attn-float attn3-float causal
};

Shape seq_shape(const MhaCase& c, int64_t len, int64_t dim) {
  if (c.unbatched) return {len, dim};
  return c.config.batch_first ? Shape{c.N, len, dim} : Shape{len, c.N, dim};
}

MultiheadAttentionInputs make_inputs(const MhaCase& c, DType dtype) {
  MultiheadAttentionInputs in;
  Generator g(77);
  const int64_t H = c.config.num_heads;
  const Shape kpm = c.unbatched ? Shape{c.S} : Shape{c.N, c.S};
  auto has = [&](const char* what) { return c.masks.find(what) != std::string::npos; };
  if (has("kpm-bool")) {
    in.key_padding_mask = rand_bool(kpm, g, 0.3);
    in.key_padding_mask.set_item(Shape(kpm.size(), 0), 0.0);  // keep one key visible
  }
  if (has("kpm-float")) in.key_padding_mask = randn(kpm, g, 0, 1, dtype);
  if (has("attn-bool")) {
    in.attn_mask = rand_bool({c.L, c.S}, g, 0.3);
    for (int64_t i = 0; i < c.L; ++i) in.attn_mask.set_item({i, i % c.S}, 0.0);
  }
  if (has("attn-float")) in.attn_mask = randn({c.L, c.S}, g, 0, 1, dtype);
  if (has("attn3-float")) in.attn_mask = randn({(c.unbatched ? 1 : c.N) * H, c.L, c.S}, g, 0, 1, dtype);
  in.is_causal = has("causal");
  return in;
}

std::vector<MhaCase> mha_cases() {
  std::vector<MhaCase> cs;
  cs.push_back({"packed", {.embed_dim = 6, .num_heads = 2}});
  cs.push_back({"batch_first", {.embed_dim = 6, .num_heads = 3, .batch_first = true}});
  cs.push_back({"kdim/vdim", {.embed_dim = 4, .num_heads = 2, .kdim = 3, .vdim = 5}});
  cs.push_back({"no bias", {.embed_dim = 6, .num_heads = 2, .bias = false}});
  cs.push_back({"add_bias_kv", {.embed_dim = 6, .num_heads = 2, .add_bias_kv = true}, 2, 5, 4, false, "kpm-bool"});
  cs.push_back({"add_zero_attn", {.embed_dim = 6, .num_heads = 2, .add_zero_attn = true}, 2, 5, 4, false, "attn-float"});
  cs.push_back({"both extras", {.embed_dim = 4, .num_heads = 2, .add_bias_kv = true, .add_zero_attn = true, .kdim = 3}, 2, 3, 4, false, "attn3-float kpm-float"});
  cs.push_back({"bool masks", {.embed_dim = 6, .num_heads = 2}, 2, 5, 4, false, "kpm-bool attn-bool"});
  cs.push_back({"float masks", {.embed_dim = 6, .num_heads = 2, .batch_first = true}, 2, 5, 4, false, "kpm-float attn3-float"});
  cs.push_back({"causal self", {.embed_dim = 6, .num_heads = 2}, 2, 4, 4, false, "causal"});
  cs.push_back({"unbatched", {.embed_dim = 6, .num_heads = 3}, 1, 5, 4, true, "kpm-bool attn-float"});
  return cs;
}

struct Built {
  Tensor query, key, value;
  MultiheadAttentionInputs inputs;
};

Built build(const MhaCase& c, DType dtype) {
  const auto& k = c.config;
  const int64_t kdim = k.kdim ? k.kdim : k.embed_dim, vdim = k.vdim ? k.vdim : k.embed_dim;
  Built b{random_tensor(seq_shape(c, c.L, k.embed_dim), 1, dtype), random_tensor(seq_shape(c, c.S, kdim), 2, dtype),
          random_tensor(seq_shape(c, c.S, vdim), 3, dtype), make_inputs(c, dtype)};
  if (c.masks.find("causal") != std::string::npos) b.key = b.value = b.query;  // self-attention
  return b;
}

// Non-zero biases so that their gradients and uses are exercised.
void randomize_biases(MultiheadAttention& m) {
  uint64_t seed = 100;
  for (NamedParameter& p : m.named_parameters())
    if (p.name.find("bias") != std::string::npos) p.value->copy_(random_tensor(p.value->shape(), seed++, p.value->dtype(), 0.5));
}

}  // namespace

TEST(MultiheadAttention, MatchesTorchAlgorithmWrittenOut) {
  for (DType dtype : {DType::float64, DType::float32}) {
    for (MhaCase c : mha_cases()) {
      SCOPED_TRACE(c.name + " " + to_string(dtype));
      c.config.dtype = dtype;
      Generator gen(5);
      MultiheadAttention m(c.config, gen);
      randomize_biases(m);
      Built b = build(c, dtype);
      for (bool average : {true, false}) {
        b.inputs.average_attn_weights = average;
        MultiheadAttentionOutput out = m.forward(b.query, b.key, b.value, b.inputs);
        Manual want = manual_mha(m, b.query.to(DType::float64), b.key.to(DType::float64), b.value.to(DType::float64), b.inputs);
        const double tol = dtype == DType::float64 ? 1e-12 : 2e-5;
        EXPECT_EQ(out.output.shape(), b.query.shape());
        EXPECT_LE(max_abs_diff(out.output, want.output), tol);
        Tensor w = want.weights;
        if (average) {
          Tensor avg = Tensor::zeros({w.size(0), w.size(2), w.size(3)}, DType::float64);
          for (int64_t n = 0; n < w.size(0); ++n)
            for (int64_t h = 0; h < w.size(1); ++h)
              for (int64_t i = 0; i < w.size(2); ++i)
                for (int64_t j = 0; j < w.size(3); ++j)
                  avg.set_item({n, i, j}, avg.item({n, i, j}) + w.item({n, h, i, j}) / double(w.size(1)));
          w = avg;
        }
        if (c.unbatched) w = w.select(0, 0);
        EXPECT_LE(max_abs_diff(out.weights, w), tol);
      }
    }
  }
}

TEST(MultiheadAttention, GradientsOfInputsAndEveryParameter) {
  double worst = 0;
  for (MhaCase c : mha_cases()) {
    SCOPED_TRACE(c.name);
    c.config.dtype = DType::float64;
    c.config.dropout = 0.25;  // training mode with a replayed seed: dropout is exercised too
    Generator gen(5);
    MultiheadAttention m(c.config, gen);
    randomize_biases(m);
    Built b = build(c, DType::float64);
    b.inputs.need_weights = false;
    const bool self = b.key.raw_data() == b.query.raw_data();
    Tensor r = random_tensor(b.query.shape(), 9);
    auto loss = [&] {
      m.dropout_generator().set_state(123, 0);
      return weighted_sum(m.forward(b.query, b.key, b.value, b.inputs).output, r);
    };
    m.zero_grad();
    loss();
    MultiheadAttentionInputGradients g = m.backward(r);
    auto check = [&](const std::string& what, Tensor x, const Tensor& grad) {
      const double e = gradient_error(x, grad, loss);
      EXPECT_LT(e, 1e-6) << what;
      EXPECT_GT(max_abs(grad), 0.0) << what;
      worst = std::max(worst, e);
    };
    if (self) {
      // One tensor passed as query, key and value: its gradient is the sum.
      Tensor sum = g.dquery.clone();
      for (Tensor* t : {&g.dkey, &g.dvalue})
        for (int64_t x = 0; x < sum.numel(); ++x) sum.data<double>()[x] += t->data<double>()[x];
      check("dinput", b.query, sum);
      // Summed by the module: the same sum, dkey and dvalue left undefined.
      m.zero_grad();
      loss();
      const MultiheadAttentionInputGradients summed = m.backward(r, {}, /*summed=*/true);
      EXPECT_LE(max_abs_diff(summed.dquery, sum), 1e-12);
      EXPECT_FALSE(summed.dkey.defined() || summed.dvalue.defined());
      for (NamedParameter& p : m.named_parameters()) check(p.name + " (summed)", *p.value, *p.grad);
    } else {
      check("dquery", b.query, g.dquery);
      check("dkey", b.key, g.dkey);
      check("dvalue", b.value, g.dvalue);
    }
    for (NamedParameter& p : m.named_parameters()) check(p.name, *p.value, *p.grad);
  }
  std::printf("  worst relative gradient error over all cases: %.1e\n", worst);
}

// One tensor as query, key and value: q, k and v come from one product and
// their gradients go back through one (fused); a copy of the tensor as key
// and value takes the three products of cross-attention. Both must agree,
// in every layout, with and without RoPE, in float32, float64 and bf16-mixed.
TEST(MultiheadAttention, SelfAttentionInOneProductMatchesThreeInputs) {
  struct Case {
    DType dtype;
    Precision precision;
    double tol;
  };
  for (Case k : {Case{DType::float64, Precision::float32, 1e-12}, Case{DType::float32, Precision::float32, 2e-5},
                 Case{DType::float32, Precision::bf16_mixed, 2e-2}})
    for (bool batch_first : {false, true})
      for (bool rope : {false, true}) {
        SCOPED_TRACE(to_string(k.dtype) + (k.precision == Precision::bf16_mixed ? " bf16-mixed" : "") +
                     (batch_first ? " batch_first" : "") + (rope ? " rope" : ""));
        const MultiheadAttentionConfig config{.embed_dim = 24, .num_heads = 3, .batch_first = batch_first,
                                              .dtype = k.dtype, .rotary_base = rope ? std::optional(100.0) : std::nullopt,
                                              .precision = k.precision};
        Generator g1(3), g2(3);
        MultiheadAttention fused(config, g1), three(config, g2);
        randomize_biases(fused);
        randomize_biases(three);
        const Tensor x = random_tensor(batch_first ? Shape{2, 13, 24} : Shape{13, 2, 24}, 4).to(k.dtype);
        const Tensor r = random_tensor(x.shape(), 5).to(k.dtype);
        const Tensor xk = x.clone(), xv = x.clone();
        const MultiheadAttentionInputs in{.need_weights = false, .is_causal = true};
        EXPECT_LE(max_abs_diff(fused.forward(x, x, x, in).output, three.forward(x, xk, xv, in).output), k.tol);
        const MultiheadAttentionInputGradients a = fused.backward(r), b = three.backward(r);
        EXPECT_LE(max_abs_diff(a.dquery, b.dquery), k.tol);
        EXPECT_LE(max_abs_diff(a.dkey, b.dkey), k.tol);
        EXPECT_LE(max_abs_diff(a.dvalue, b.dvalue), k.tol);
        const std::vector<NamedParameter> pa = fused.named_parameters(), pb = three.named_parameters();
        for (size_t i = 0; i < pa.size(); ++i) EXPECT_LE(max_abs_diff(*pa[i].grad, *pb[i].grad), k.tol) << pa[i].name;
        // Summed: one product in the fused module, the additions in the other.
        fused.forward(x, x, x, in);
        three.forward(x, xk, xv, in);
        const Tensor sum = add(add(b.dquery, b.dkey), b.dvalue);
        EXPECT_LE(max_abs_diff(fused.backward(r, {}, true).dquery, sum), 4 * k.tol);
        EXPECT_LE(max_abs_diff(three.backward(r, {}, true).dquery, sum), 4 * k.tol);
        for (size_t i = 0; i < pa.size(); ++i) EXPECT_LE(max_abs_diff(*pa[i].grad, *pb[i].grad), 2 * k.tol) << pa[i].name;
      }
  // Summed needs inputs of one shape: cross-attention over another length is refused.
  Generator g(1);
  MultiheadAttention m({.embed_dim = 4, .num_heads = 2, .dtype = DType::float64}, g);
  const Tensor q = random_tensor({3, 2, 4}, 1), kv = random_tensor({5, 2, 4}, 2);
  m.forward(q, kv, kv);
  EXPECT_THROW(m.backward(random_tensor({3, 2, 4}, 3), {}, true), ShapeError);
}

TEST(MultiheadAttention, BackwardAccumulatesIntoGrads) {
  Generator gen(1);
  MultiheadAttention m({.embed_dim = 4, .num_heads = 2, .dtype = DType::float64}, gen);
  Tensor x = random_tensor({3, 2, 4}, 2);
  Tensor r = random_tensor({3, 2, 4}, 3);
  m.forward(x, x, x);
  m.backward(r);
  const std::vector<double> once = m.out_proj_weight_grad.to_vector();
  m.forward(x, x, x);
  m.backward(r);
  const std::vector<double> twice = m.out_proj_weight_grad.to_vector();
  for (size_t i = 0; i < once.size(); ++i) EXPECT_NEAR(twice[i], 2 * once[i], 1e-12);
  m.zero_grad();
  EXPECT_EQ(max_abs(m.out_proj_weight_grad), 0.0);
}

TEST(MultiheadAttention, InitialisedAsTorch) {
  Generator gen(3);
  MultiheadAttention m({.embed_dim = 64, .num_heads = 8, .add_bias_kv = true}, gen);
  const double bound = std::sqrt(6.0 / (64.0 + 192.0));
  EXPECT_LE(max_abs(m.in_proj_weight), bound);
  EXPECT_GT(max_abs(m.in_proj_weight), 0.9 * bound);
  EXPECT_EQ(max_abs(m.in_proj_bias), 0.0);
  EXPECT_EQ(max_abs(m.out_proj_bias), 0.0);
  EXPECT_LE(max_abs(m.out_proj_weight), 1.0 / 8.0);
  EXPECT_EQ(m.bias_k.shape(), (Shape{1, 1, 64}));
  std::vector<std::string> names;
  for (const NamedParameter& p : m.named_parameters()) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"in_proj_weight", "in_proj_bias", "bias_k", "bias_v", "out_proj.weight",
                                             "out_proj.bias"}));
  MultiheadAttention s({.embed_dim = 8, .num_heads = 2, .bias = false, .kdim = 3, .vdim = 5}, gen);
  EXPECT_FALSE(s.packed_in_proj());
  EXPECT_EQ(s.k_proj_weight.shape(), (Shape{8, 3}));
  EXPECT_EQ(s.v_proj_weight.shape(), (Shape{8, 5}));
  EXPECT_FALSE(s.in_proj_bias.defined());
}

TEST(MultiheadAttention, DropoutOnlyInTraining) {
  Generator gen(4);
  MultiheadAttention m({.embed_dim = 8, .num_heads = 2, .dropout = 0.5}, gen);
  Tensor x = random_tensor({6, 2, 8}, 1, DType::float32);
  const Tensor train1 = m.forward(x, x, x).output, train2 = m.forward(x, x, x).output;
  EXPECT_GT(max_abs_diff(train1, train2), 1e-4);  // a fresh dropout pattern each call
  m.eval();
  const Tensor eval1 = m.forward(x, x, x).output, eval2 = m.forward(x, x, x).output;
  EXPECT_EQ(max_abs_diff(eval1, eval2), 0.0);
  Generator gen2(4);
  MultiheadAttention no_dropout({.embed_dim = 8, .num_heads = 2}, gen2);
  EXPECT_LE(max_abs_diff(eval1, no_dropout.forward(x, x, x).output), 1e-6);
}

TEST(MultiheadAttention, FullyMaskedSequenceGivesBiasNotNaN) {
  Generator gen(4);
  MultiheadAttention m({.embed_dim = 4, .num_heads = 2, .batch_first = true, .dtype = DType::float64}, gen);
  randomize_biases(m);
  Tensor x = random_tensor({2, 3, 4}, 1);
  Tensor kpm = Tensor::from_bools({true, true, true, false, false, true}, {2, 3});  // batch 0: all padded
  auto out = m.forward(x, x, x, {.key_padding_mask = kpm});
  EXPECT_TRUE(all_finite(out.output));
  EXPECT_TRUE(all_finite(out.weights));
  for (int64_t e = 0; e < 4; ++e) EXPECT_NEAR(out.output.item({0, 1, e}), m.out_proj_bias.item({e}), 1e-15);
  auto g = m.backward(random_tensor({2, 3, 4}, 2));
  EXPECT_TRUE(all_finite(g.dquery) && all_finite(m.in_proj_weight_grad));
}

TEST(MultiheadAttention, WeightsShapes) {
  Generator gen(4);
  MultiheadAttention m({.embed_dim = 6, .num_heads = 3, .add_bias_kv = true, .add_zero_attn = true}, gen);
  Tensor q = random_tensor({5, 2, 6}, 1, DType::float32), kv = random_tensor({4, 2, 6}, 2, DType::float32);
  EXPECT_EQ(m.forward(q, kv, kv).weights.shape(), (Shape{2, 5, 6}));
  EXPECT_EQ(m.forward(q, kv, kv, {.average_attn_weights = false}).weights.shape(), (Shape{2, 3, 5, 6}));
  EXPECT_FALSE(m.forward(q, kv, kv, {.need_weights = false}).weights.defined());
  EXPECT_EQ(m.forward(q.select(1, 0), kv.select(1, 0), kv.select(1, 0)).weights.shape(), (Shape{5, 6}));
}
