// Reference attention forward against a textbook computation in double:
// masks, causal alignments, broadcasting, GQA, dropout and edge cases.
#include <omp.h>

#include "testing.h"

using namespace mha;
using namespace mha::testing;

namespace {

struct Case {
  std::string name;
  Shape q, k, v, batch;
  AttentionOptions options;
};

void expect_matches_naive(const Case& c, DType dtype, double tol) {
  SCOPED_TRACE(c.name + " " + to_string(dtype));
  Tensor q = random_tensor(c.q, 1, dtype), k = random_tensor(c.k, 2, dtype), v = random_tensor(c.v, 3, dtype);
  AttentionOptions o = c.options;
  o.return_weights = true;
  AttentionOutput r = attention_forward(q, k, v, o);
  Naive n = naive_attention(q.to(DType::float64), k.to(DType::float64), v.to(DType::float64), o, c.batch);
  // The documented rule: fused for float32 and bfloat16, reference for float64.
  EXPECT_EQ(r.path, dtype == DType::float64 ? AttentionPath::reference : AttentionPath::fused);
  EXPECT_LE(max_abs_diff(r.out, n.out), tol);
  EXPECT_LE(max_abs_diff(r.weights, n.weights), tol);
  std::vector<double> a = r.lse.to_vector(), b = n.lse.to_vector();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(b[i])) EXPECT_EQ(a[i], b[i]);
    else EXPECT_NEAR(a[i], b[i], tol * 10);
  }
  EXPECT_TRUE(all_finite(r.out));
}

std::vector<Case> cases() {
  std::vector<Case> cs;
  const Shape q{2, 3, 7, 3}, k{2, 3, 5, 3}, v{2, 3, 5, 2}, batch{2, 3};
  cs.push_back({"plain", q, k, v, batch, {}});
  cs.push_back({"scale", q, k, v, batch, {.scale = 0.7}});
  cs.push_back({"L=S", {2, 3, 5, 3}, k, v, batch, {}});
  Generator g(9);
  cs.push_back({"bool mask full", q, k, v, batch, {.mask = rand_bool({2, 3, 7, 5}, g, 0.7)}});
  cs.push_back({"bool mask (L,S)", q, k, v, batch, {.mask = rand_bool({7, 5}, g, 0.6)}});
  cs.push_back({"bool key padding (B,1,1,S)", q, k, v, batch, {.mask = rand_bool({2, 1, 1, 5}, g, 0.6)}});
  cs.push_back({"float mask (H,1,S)", q, k, v, batch, {.mask = randn({3, 1, 5}, g)}});
  cs.push_back({"float64 mask on float32", q, k, v, batch, {.mask = randn({7, 5}, g, 0, 1, DType::float64)}});
  cs.push_back({"causal top-left L>S", q, k, v, batch, {.causal = Causal::top_left}});
  cs.push_back({"causal bottom-right L>S", q, k, v, batch, {.causal = Causal::bottom_right}});
  cs.push_back({"causal top-left L<S", {2, 3, 3, 3}, k, v, batch, {.causal = Causal::top_left}});
  cs.push_back({"causal bottom-right L<S", {2, 3, 3, 3}, k, v, batch, {.causal = Causal::bottom_right}});
  cs.push_back({"causal and mask", q, k, v, batch, {.mask = rand_bool({7, 5}, g, 0.8), .causal = Causal::top_left}});
  cs.push_back({"GQA 6/2", {2, 6, 7, 3}, {2, 2, 5, 3}, {2, 2, 5, 2}, {2, 6}, {}});
  cs.push_back({"MQA 4/1", {2, 4, 7, 3}, {2, 1, 5, 3}, {2, 1, 5, 2}, {2, 4}, {.causal = Causal::bottom_right}});
  cs.push_back({"broadcast batch", {1, 3, 7, 3}, {2, 1, 5, 3}, {2, 3, 5, 2}, {2, 3}, {}});
  cs.push_back({"3-D inputs", {3, 7, 3}, {3, 5, 3}, {3, 5, 2}, {3}, {}});
  cs.push_back({"2-D inputs", {7, 3}, {5, 3}, {5, 2}, {}, {}});
  cs.push_back({"extra leading dims", {2, 1, 2, 7, 3}, {1, 3, 2, 5, 3}, {1, 3, 2, 5, 2}, {2, 3, 2}, {}});
  cs.push_back({"dropout", q, k, v, batch, {.dropout_p = 0.3, .dropout_seed = 17}});
  cs.push_back({"L=1", {2, 3, 1, 3}, k, v, batch, {.causal = Causal::bottom_right}});
  cs.push_back({"S=1", q, {2, 3, 1, 3}, {2, 3, 1, 2}, batch, {}});
  return cs;
}

}  // namespace

TEST(Attention, MatchesNaiveFloat64) {
  for (const Case& c : cases()) expect_matches_naive(c, DType::float64, 1e-12);
}

TEST(Attention, MatchesNaiveFloat32) {
  for (const Case& c : cases()) expect_matches_naive(c, DType::float32, 2e-6);
}

TEST(Attention, Bfloat16MatchesFloat32OnRoundedInputs) {
  Tensor q = random_tensor({2, 3, 9, 8}, 1, DType::bfloat16), k = random_tensor({2, 3, 11, 8}, 2, DType::bfloat16),
         v = random_tensor({2, 3, 11, 5}, 3, DType::bfloat16);
  AttentionOutput b = attention_forward(q, k, v, {.causal = Causal::bottom_right});
  AttentionOutput f = attention_forward(q.to(DType::float32), k.to(DType::float32), v.to(DType::float32),
                                        {.causal = Causal::bottom_right});
  EXPECT_EQ(b.out.dtype(), DType::bfloat16);
  EXPECT_EQ(b.lse.dtype(), DType::float32);
  // Output rounding to bf16 only: relative 2^-8.
  EXPECT_LE(max_abs_diff(b.out.to(DType::float32), f.out), max_abs(f.out) * 0.005);
  EXPECT_LE(max_abs_diff(b.lse, f.lse), 1e-6);
}

TEST(Attention, WeightsRowsSumToOneAndLseIsLogSumExp) {
  Tensor q = random_tensor({2, 5, 4}, 1), k = random_tensor({2, 6, 4}, 2), v = random_tensor({2, 6, 3}, 3);
  AttentionOutput r = attention_forward(q, k, v, {.return_weights = true});
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 5; ++i) {
      double sum = 0, lse = 0;
      for (int64_t j = 0; j < 6; ++j) sum += r.weights.item({b, i, j});
      EXPECT_NEAR(sum, 1.0, 1e-14);
      for (int64_t j = 0; j < 6; ++j) {
        double dot = 0;
        for (int64_t e = 0; e < 4; ++e) dot += q.item({b, i, e}) * k.item({b, j, e});
        lse += std::exp(dot / 2.0);
      }
      EXPECT_NEAR(r.lse.item({b, i}), std::log(lse), 1e-13);
    }
}

TEST(Attention, FullyMaskedRowsGiveZeroNotNaN) {
  for (DType dtype : {DType::float32, DType::float64, DType::bfloat16}) {
    Tensor q = random_tensor({2, 4, 3}, 1, dtype), k = random_tensor({2, 5, 3}, 2, dtype),
           v = random_tensor({2, 5, 2}, 3, dtype);
    std::vector<bool> allowed(2 * 4 * 5, true);
    for (int j = 0; j < 5; ++j) allowed[size_t(1 * 5 + j)] = false;           // batch 0, row 1
    for (int j = 0; j < 5; ++j) allowed[size_t((4 + 3) * 5 + j)] = false;     // batch 1, row 3
    AttentionOptions o{.mask = Tensor::from_bools(allowed, {2, 4, 5}), .return_weights = true};
    AttentionOutput r = attention_forward(q, k, v, o);
    EXPECT_TRUE(all_finite(r.out)) << to_string(dtype);
    EXPECT_TRUE(all_finite(r.weights)) << to_string(dtype);
    for (int64_t e = 0; e < 2; ++e) {
      EXPECT_EQ(r.out.item({0, 1, e}), 0.0);
      EXPECT_EQ(r.out.item({1, 3, e}), 0.0);
    }
    for (int64_t j = 0; j < 5; ++j) EXPECT_EQ(r.weights.item({0, 1, j}), 0.0);
    EXPECT_EQ(r.lse.item({0, 1}), -INFINITY);
    EXPECT_NE(r.out.item({0, 0, 0}), 0.0);
    // Backward: zero gradient from those rows, no NaN anywhere.
    Tensor dout = random_tensor(r.out.shape(), 4, dtype);
    AttentionGradients g = attention_backward(dout, q, k, v, r, o);
    EXPECT_TRUE(all_finite(g.dquery) && all_finite(g.dkey) && all_finite(g.dvalue));
    for (int64_t e = 0; e < 3; ++e) EXPECT_EQ(g.dquery.item({0, 1, e}), 0.0);
  }
}

TEST(Attention, MinusInfinityInAdditiveMaskAndCausalEmptyRows) {
  Tensor q = random_tensor({1, 4, 3}, 1), k = random_tensor({1, 2, 3}, 2), v = random_tensor({1, 2, 2}, 3);
  Tensor mask = Tensor::from_values(std::vector<double>{-INFINITY, 0.5, -INFINITY, -INFINITY}, {2, 2}, DType::float64)
                    .expand({2, 2})
                    .slice(0, 0, 1)
                    .expand({4, 2});
  AttentionOutput r = attention_forward(q, k, v, {.mask = mask});
  EXPECT_TRUE(all_finite(r.out));
  EXPECT_NEAR(r.out.item({0, 2, 1}), v.item({0, 1, 1}), 1e-15);  // only key 1 visible
  // Bottom-right causal with L > S: the first L - S rows see nothing.
  AttentionOutput c = attention_forward(q, k, v, {.causal = Causal::bottom_right, .return_weights = true});
  EXPECT_EQ(c.out.item({0, 0, 0}), 0.0);
  EXPECT_EQ(c.out.item({0, 1, 1}), 0.0);
  EXPECT_EQ(c.lse.item({0, 1}), -INFINITY);
  EXPECT_NEAR(c.out.item({0, 2, 0}), v.item({0, 0, 0}), 1e-15);
}

TEST(Attention, HugeLogitsDoNotOverflow) {
  for (DType dtype : {DType::float32, DType::float64}) {
    Tensor q = Tensor::full({1, 3, 2}, 100.0, dtype), k = random_tensor({1, 4, 2}, 2, dtype, 1.0),
           v = random_tensor({1, 4, 2}, 3, dtype);
    // logits = 100 · (k0 + k1) · scale with scale 1: about ±1e4... make them 1e4 exactly in size.
    AttentionOutput r = attention_forward(q, k, v, {.scale = 50.0, .return_weights = true});
    EXPECT_TRUE(all_finite(r.out)) << to_string(dtype);
    EXPECT_TRUE(all_finite(r.lse)) << to_string(dtype);
    EXPECT_GT(max_abs(r.lse), 1e3);
    Naive n = naive_attention(q.to(DType::float64), k.to(DType::float64), v.to(DType::float64), {.scale = 50.0}, {1});
    EXPECT_LE(max_abs_diff(r.out, n.out), dtype == DType::float64 ? 1e-12 : 1e-5);
  }
}

TEST(Attention, NonContiguousInputsMatchContiguous) {
  // Build (B, H, L, E) as a permuted view of (B, L, H, E), and a sliced key.
  Tensor q = random_tensor({2, 7, 3, 4}, 1).permute({0, 2, 1, 3});
  Tensor k = random_tensor({2, 3, 10, 4}, 2).slice(2, 0, 10, 2);  // every other key: S = 5
  Tensor v = random_tensor({2, 3, 5, 6}, 3).slice(3, 1, 6, 2);    // Ev = 3, stride 2
  ASSERT_FALSE(q.is_contiguous());
  ASSERT_FALSE(k.is_contiguous());
  ASSERT_FALSE(v.is_contiguous());
  Generator g(3);
  Tensor mask = randn({3, 7, 5}, g, 0, 1, DType::float64).transpose(0, 0);
  AttentionOptions o{.mask = mask, .causal = Causal::bottom_right};
  AttentionOutput a = attention_forward(q, k, v, o);
  AttentionOutput b = attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), o);
  EXPECT_EQ(max_abs_diff(a.out, b.out), 0.0);
  Tensor dout = random_tensor(a.out.shape(), 4).transpose(2, 3).contiguous().transpose(2, 3);
  AttentionGradients ga = attention_backward(dout, q, k, v, a, o);
  AttentionGradients gb = attention_backward(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), b, o);
  EXPECT_EQ(max_abs_diff(ga.dquery, gb.dquery), 0.0);
  EXPECT_EQ(max_abs_diff(ga.dkey, gb.dkey), 0.0);
  EXPECT_EQ(max_abs_diff(ga.dvalue, gb.dvalue), 0.0);
}

TEST(Attention, GroupedQueryEqualsRepeatedKeysAndValues) {
  Tensor q = random_tensor({2, 6, 5, 4}, 1), k = random_tensor({2, 2, 7, 4}, 2), v = random_tensor({2, 2, 7, 3}, 3);
  // Repeat each kv head 3 times: head h of the query reads kv head h / 3.
  Tensor kr = Tensor::empty({2, 6, 7, 4}, DType::float64), vr = Tensor::empty({2, 6, 7, 3}, DType::float64);
  for (int64_t h = 0; h < 6; ++h) {
    kr.slice(1, h, h + 1).copy_(k.slice(1, h / 3, h / 3 + 1));
    vr.slice(1, h, h + 1).copy_(v.slice(1, h / 3, h / 3 + 1));
  }
  AttentionOptions o{.causal = Causal::top_left, .dropout_p = 0.2, .dropout_seed = 5};
  AttentionOutput a = attention_forward(q, k, v, o), b = attention_forward(q, kr, vr, o);
  EXPECT_LE(max_abs_diff(a.out, b.out), 1e-15);
  Tensor dout = random_tensor(a.out.shape(), 4);
  AttentionGradients ga = attention_backward(dout, q, k, v, a, o), gb = attention_backward(dout, q, kr, vr, b, o);
  EXPECT_LE(max_abs_diff(ga.dquery, gb.dquery), 1e-14);
  // dK of a shared head is the sum over the query heads of its group.
  Tensor summed = Tensor::zeros({2, 2, 7, 4}, DType::float64);
  for (int64_t b2 = 0; b2 < 2; ++b2)
    for (int64_t h = 0; h < 6; ++h)
      for (int64_t j = 0; j < 7; ++j)
        for (int64_t e = 0; e < 4; ++e)
          summed.set_item({b2, h / 3, j, e}, summed.item({b2, h / 3, j, e}) + gb.dkey.item({b2, h, j, e}));
  EXPECT_LE(max_abs_diff(ga.dkey, summed), 1e-14);
}

TEST(Attention, BottomRightCausalMatchesDecodingStep) {
  // The last query of a causal self-attention over 9 tokens equals one
  // decoding step (L = 1) against the 9 cached keys, bottom-right aligned.
  Tensor x = random_tensor({2, 9, 4}, 1), v = random_tensor({2, 9, 3}, 2);
  AttentionOutput full = attention_forward(x, x, v, {.causal = Causal::top_left});
  AttentionOutput step = attention_forward(x.slice(1, 8, 9), x, v, {.causal = Causal::bottom_right});
  EXPECT_LE(max_abs_diff(step.out, full.out.slice(1, 8, 9)), 1e-15);
  // Top-left with L = 1 would see only the first key.
  AttentionOutput tl = attention_forward(x.slice(1, 8, 9), x, v, {.causal = Causal::top_left});
  EXPECT_LE(max_abs_diff(tl.out, v.slice(1, 0, 1)), 1e-15);
}

TEST(Attention, DropoutIsSeededAndScaled) {
  Tensor q = random_tensor({4, 32, 8}, 1), k = random_tensor({4, 32, 8}, 2), v = random_tensor({4, 32, 8}, 3);
  AttentionOptions o{.dropout_p = 0.25, .dropout_seed = 99, .return_weights = true};
  AttentionOutput a = attention_forward(q, k, v, o), b = attention_forward(q, k, v, o);
  EXPECT_EQ(max_abs_diff(a.out, b.out), 0.0);
  AttentionOptions other = o;
  other.dropout_seed = 100;
  EXPECT_GT(max_abs_diff(a.out, attention_forward(q, k, v, other).out), 1e-3);
  AttentionOutput clean = attention_forward(q, k, v, {.return_weights = true});
  int64_t dropped = 0, n = 0;
  std::vector<double> w = a.weights.to_vector(), c = clean.weights.to_vector();
  for (size_t i = 0; i < w.size(); ++i, ++n) {
    if (w[i] == 0.0) ++dropped;
    else EXPECT_NEAR(w[i], c[i] / 0.75, 1e-12);
  }
  EXPECT_NEAR(double(dropped) / double(n), 0.25, 0.02);
}

TEST(Attention, ResultsDoNotDependOnThreadCount) {
  Tensor q = random_tensor({3, 4, 33, 8}, 1, DType::float32), k = random_tensor({3, 2, 17, 8}, 2, DType::float32),
         v = random_tensor({3, 2, 17, 5}, 3, DType::float32);
  Generator g(1);
  AttentionOptions o{.mask = randn({4, 33, 17}, g), .dropout_p = 0.1, .dropout_seed = 3};
  Tensor dout = random_tensor({3, 4, 33, 5}, 4, DType::float32);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  AttentionOutput a = attention_forward(q, k, v, o);
  AttentionGradients ga = attention_backward(dout, q, k, v, a, o, true);
  omp_set_num_threads(2);
  AttentionOutput b = attention_forward(q, k, v, o);
  AttentionGradients gb = attention_backward(dout, q, k, v, b, o, true);
  omp_set_num_threads(saved);
  EXPECT_EQ(a.out.to_vector(), b.out.to_vector());
  EXPECT_EQ(ga.dquery.to_vector(), gb.dquery.to_vector());
  EXPECT_EQ(ga.dkey.to_vector(), gb.dkey.to_vector());
  EXPECT_EQ(ga.dvalue.to_vector(), gb.dvalue.to_vector());
  EXPECT_EQ(ga.dmask.to_vector(), gb.dmask.to_vector());
}
