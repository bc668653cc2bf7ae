// Feature-map ("kernel") attention: linear attention (elu + 1) against its
// dense definition, causal and not, across chunk and thread-segment borders;
// Performer's error against exact softmax attention falling as the number of
// random features grows; finite-difference gradients in double; the feature
// draw; extreme inputs and L = 1 without NaN; typed errors.
#include "mha/variants/linear_attention.h"
#include "mha/variants/performer.h"
#include "variants_testing.h"

using namespace mha;
using namespace mha::testing;

namespace {

double elu_plus_one(double x) { return x > 0 ? x + 1 : std::exp(x); }

// Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j) straight from the definition (j <= i when causal).
Tensor dense_linear_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  const int64_t B = shape_numel(Shape(q.shape().begin(), q.shape().end() - 2)), L = q.size(-2), S = k.size(-2),
                E = q.size(-1), Ev = v.size(-1);
  std::vector<double> qv = q.to_vector(), kv = k.to_vector(), vv = v.to_vector(), out(size_t(B * L * Ev), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < L; ++i) {
      double den = 0;
      for (int64_t j = 0; j < (causal ? i + 1 : S); ++j) {
        double w = 0;
        for (int64_t e = 0; e < E; ++e)
          w += elu_plus_one(qv[size_t((b * L + i) * E + e)]) * elu_plus_one(kv[size_t((b * S + j) * E + e)]);
        den += w;
        for (int64_t e = 0; e < Ev; ++e) out[size_t((b * L + i) * Ev + e)] += w * vv[size_t((b * S + j) * Ev + e)];
      }
      for (int64_t e = 0; e < Ev; ++e) out[size_t((b * L + i) * Ev + e)] /= den;
    }
  Shape shape = q.shape();
  shape.back() = Ev;
  return Tensor::from_values(out, shape, DType::float64);
}

template <class Forward, class Backward>
void check_gradients(const std::string& name, const Shape& qs, const Shape& ks, const Shape& vs, Forward forward,
                     Backward backward) {
  Tensor q = random_tensor(qs, 11), k = random_tensor(ks, 12), v = random_tensor(vs, 13);
  LinearAttentionOutput fwd = forward(q, k, v);
  Tensor r = random_tensor(fwd.out.shape(), 14);
  AttentionGradients g = backward(r, q, k, v, fwd);
  expect_gradients(name, r, [&] { return forward(q, k, v).out; }, {{"dq", q, g.dquery}, {"dk", k, g.dkey}, {"dv", v, g.dvalue}});
}

}  // namespace

TEST(LinearAttention, EqualsDenseDefinition) {
  // L = 150: three chunks of 64, split over the threads' segments.
  for (bool causal : {false, true}) {
    const int64_t S = causal ? 150 : 29;
    for (DType dtype : {DType::float64, DType::float32}) {
      SCOPED_TRACE(std::string(causal ? "causal " : "") + to_string(dtype));
      Tensor q = random_tensor({2, 3, 150, 5}, 1, dtype), k = random_tensor({2, 3, S, 5}, 2, dtype),
             v = random_tensor({2, 3, S, 3}, 3, dtype);
      LinearAttentionOutput f = linear_attention_forward(q, k, v, {.causal = causal});
      EXPECT_LT(max_abs_diff(f.out, dense_linear_attention(q.to(DType::float64), k.to(DType::float64),
                                                           v.to(DType::float64), causal)),
                dtype == DType::float64 ? 1e-12 : 2e-5);
      EXPECT_EQ(f.normalizer.shape(), (Shape{2, 3, 150}));
    }
  }
}

TEST(LinearAttention, NonContiguousInputs) {
  Tensor q = random_tensor({2, 70, 3, 4}, 1).permute({0, 2, 1, 3});  // (2, 3, 70, 4) strided
  Tensor k = random_tensor({2, 3, 70, 8}, 2).slice(3, 0, 8, 2);
  Tensor v = random_tensor({2, 3, 70, 2}, 3);
  LinearAttentionOutput f = linear_attention_forward(q, k, v, {.causal = true});
  EXPECT_LT(max_abs_diff(f.out, dense_linear_attention(q, k, v, true)), 1e-12);
}

TEST(LinearAttention, FiniteDifferenceGradients) {
  for (bool causal : {false, true}) {
    const LinearAttentionOptions o{.causal = causal};
    const int64_t L = causal ? 70 : 7;  // 70: two chunks, and two segments on two threads
    check_gradients(causal ? "linear causal L=70 E=3 Ev=2" : "linear L=7 S=5 E=3 Ev=2", {2, L, 3},
                    {2, causal ? L : 5, 3}, {2, causal ? L : 5, 2},
                    [&](auto& q, auto& k, auto& v) { return linear_attention_forward(q, k, v, o); },
                    [&](auto& d, auto& q, auto& k, auto& v, auto& f) { return linear_attention_backward(d, q, k, v, f, o); });
  }
}

TEST(Performer, FiniteDifferenceGradients) {
  for (bool causal : {false, true}) {
    const PerformerOptions o{.features = performer_features(9, 3, 5, DType::float64), .causal = causal, .scale = 0.8};
    const int64_t L = causal ? 67 : 7;
    check_gradients(causal ? "performer causal L=67 m=9" : "performer L=7 S=5 m=9", {2, L, 3}, {2, causal ? L : 5, 3},
                    {2, causal ? L : 5, 2},
                    [&](auto& q, auto& k, auto& v) { return performer_attention_forward(q, k, v, o); },
                    [&](auto& d, auto& q, auto& k, auto& v, auto& f) { return performer_attention_backward(d, q, k, v, f, o); });
  }
}

TEST(Performer, ErrorFallsAsFeaturesGrow) {
  // Relative error against exact softmax attention, the mean over four feature draws.
  Tensor q = random_tensor({2, 64, 16}, 1, DType::float64, 0.6), k = random_tensor({2, 64, 16}, 2, DType::float64, 0.6),
         v = random_tensor({2, 64, 8}, 3);
  for (bool causal : {false, true}) {
    const Tensor exact =
        attention_forward(q, k, v, {.causal = causal ? Causal::top_left : Causal::none, .path = AttentionPath::reference}).out;
    std::vector<double> errors;
    std::printf("  performer %s:", causal ? "causal" : "non-causal");
    for (int64_t m : {16, 64, 256, 1024}) {
      double sum = 0;
      for (uint64_t seed = 0; seed < 4; ++seed) {
        const PerformerOptions o{.features = performer_features(m, 16, seed, DType::float64), .causal = causal};
        sum += relative_error(performer_attention_forward(q, k, v, o).out, exact);
      }
      errors.push_back(sum / 4);
      std::printf(" m=%lld %.3f", (long long)m, errors.back());
    }
    std::printf("\n");
    for (size_t x = 1; x < errors.size(); ++x) EXPECT_LT(errors[x], errors[x - 1]) << "m step " << x;
    EXPECT_LT(errors.back(), errors.front() / 4);  // 1/√m: 64× the features, ~8× less error
  }
}

TEST(Performer, FeatureDraw) {
  const Tensor a = performer_features(40, 16, 7, DType::float64), b = performer_features(40, 16, 7, DType::float64);
  EXPECT_EQ(max_abs_diff(a, b), 0.0);
  EXPECT_GT(max_abs_diff(a, performer_features(40, 16, 8, DType::float64)), 0.1);
  EXPECT_EQ(performer_features(40, 16, 7).dtype(), DType::float32);
  std::vector<double> w = a.to_vector();
  double mean_square_norm = 0;
  for (int64_t r = 0; r < 40; ++r) {
    for (int64_t p = r - r % 16; p < r; ++p) {  // rows within a block of 16 are orthogonal
      double dot = 0;
      for (int64_t e = 0; e < 16; ++e) dot += w[size_t(r * 16 + e)] * w[size_t(p * 16 + e)];
      EXPECT_NEAR(dot, 0.0, 1e-10) << r << " " << p;
    }
    for (int64_t e = 0; e < 16; ++e) mean_square_norm += w[size_t(r * 16 + e)] * w[size_t(r * 16 + e)] / 40;
  }
  EXPECT_NEAR(mean_square_norm, 16.0, 4.0);  // E|ω|² = E
}

TEST(KernelAttention, LengthOneAndExtremeInputsGiveNoNaN) {
  for (bool causal : {false, true}) {
    for (DType dtype : {DType::float32, DType::float64}) {
      Tensor q = random_tensor({2, 1, 4}, 1, dtype), k = random_tensor({2, 1, 4}, 2, dtype), v = random_tensor({2, 1, 3}, 3, dtype);
      LinearAttentionOutput f = linear_attention_forward(q, k, v, {.causal = causal});
      EXPECT_LT(max_abs_diff(f.out, v), 1e-6);  // one key: weight 1
      const PerformerOptions o{.features = performer_features(8, 4, 1, dtype), .causal = causal};
      LinearAttentionOutput p = performer_attention_forward(q, k, v, o);
      EXPECT_LT(max_abs_diff(p.out, v), 1e-6);
      // Large keys (|y|²/2 far beyond exp's range) and very negative queries.
      Tensor big = random_tensor({2, 90, 4}, 4, dtype, 30.0), neg = Tensor::full({2, 90, 4}, -200.0, dtype),
             vv = random_tensor({2, 90, 3}, 5, dtype);
      LinearAttentionOutput a = performer_attention_forward(big, big, vv, o);
      LinearAttentionOutput b = linear_attention_forward(neg, big, vv, {.causal = causal});
      EXPECT_TRUE(all_finite(a.out) && all_finite(b.out));
      AttentionGradients ga = performer_attention_backward(vv, big, big, vv, a, o);
      AttentionGradients gb = linear_attention_backward(vv, neg, big, vv, b, {.causal = causal});
      for (const Tensor* t : {&ga.dquery, &ga.dkey, &ga.dvalue, &gb.dquery, &gb.dkey, &gb.dvalue}) EXPECT_TRUE(all_finite(*t));
    }
  }
}

TEST(KernelAttention, Errors) {
  Tensor q = random_tensor({2, 10, 4}, 1), k = random_tensor({2, 12, 4}, 2), v = random_tensor({2, 12, 3}, 3);
  expect_error<ShapeError>([&] { linear_attention_forward(q, k, v, {.causal = true}); },
         "[mha::linear_attention_forward] key: expected S = L = 10 for causal attention; got (2, 12, 4)");
  expect_error<ShapeError>([&] { linear_attention_forward(q, k, random_tensor({2, 11, 3}, 1)); }, "value: expected dim -2 S = 12 (key's)");
  const PerformerOptions o{.features = performer_features(8, 4, 0, DType::float64)};
  expect_error<ShapeError>([&] { performer_attention_forward(q, k, v, {}); },
         "[mha::performer_attention_forward] options.features: expected a defined tensor");
  expect_error<ShapeError>([&] { performer_attention_forward(q, k, v, {.features = performer_features(8, 5, 0, DType::float64)}); },
         "options.features: expected dim -1 E = 4 (query's); got (8, 5)");
  expect_error<DtypeError>([&] { performer_attention_forward(q, k, v, {.features = performer_features(8, 4, 0)}); },
         "options.features: expected query's dtype float64; got float32");
  expect_error<ValueError>([&] { performer_attention_forward(q, k, v, {.features = o.features, .scale = -1.0}); }, "scale: expected a scale >= 0");
  expect_error<ValueError>([&] { performer_features(0, 4, 0); }, "[mha::performer_features] features: expected >= 1; got 0");
  LinearAttentionOutput f = performer_attention_forward(q, k, v, o);
  expect_error<ShapeError>([&] { performer_attention_backward(f.out, q, k, v, {f.out, Tensor()}, o); },
         "[mha::performer_attention_backward] forward.normalizer: expected a defined tensor");
}
