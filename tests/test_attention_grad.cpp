// Finite-difference checks of attention_backward in double: every input,
// the additive mask, every mask kind, causal alignments, GQA, broadcasting,
// dropout and non-contiguous inputs. Relative error must stay below 1e-6.
#include <cstdio>

#include "testing.h"

using namespace mha;
using namespace mha::testing;

namespace {

struct GradCase {
  std::string name;
  Shape q, k, v;
  AttentionOptions options;
  bool mask_grad = false;
};

// Checks d(Σ out∘R)/d{query, key, value, mask} against central differences.
void check_gradients(const GradCase& c) {
  SCOPED_TRACE(c.name);
  Tensor q = random_tensor(c.q, 11), k = random_tensor(c.k, 12), v = random_tensor(c.v, 13);
  AttentionOptions o = c.options;
  if (o.mask.defined() && o.mask.dtype() != DType::boolean) o.mask = o.mask.to(DType::float64).clone();
  AttentionOutput fwd = attention_forward(q, k, v, o);
  Tensor r = random_tensor(fwd.out.shape(), 14);
  AttentionGradients g = attention_backward(r, q, k, v, fwd, o, c.mask_grad);
  auto loss = [&] { return weighted_sum(attention_forward(q, k, v, o).out, r); };
  const double eq = gradient_error(q, g.dquery, loss), ek = gradient_error(k, g.dkey, loss),
               ev = gradient_error(v, g.dvalue, loss);
  EXPECT_LT(eq, 1e-6) << "dquery";
  EXPECT_LT(ek, 1e-6) << "dkey";
  EXPECT_LT(ev, 1e-6) << "dvalue";
  EXPECT_GT(max_abs(g.dvalue), 0.0);
  if (c.k[c.k.size() - 2] > 1) {  // with S = 1 the softmax is constant: dq = dk = 0
    EXPECT_GT(max_abs(g.dquery) + max_abs(g.dkey), 0.0);
  }
  std::printf("  %-40s relative error dq %.1e dk %.1e dv %.1e\n", c.name.c_str(), eq, ek, ev);
  if (c.mask_grad) {
    ASSERT_TRUE(g.dmask.defined());
    EXPECT_EQ(g.dmask.shape(), o.mask.shape());
    const double em = gradient_error(o.mask, g.dmask, loss);
    EXPECT_LT(em, 1e-6) << "dmask";
    std::printf("  %-40s relative error dmask %.1e\n", c.name.c_str(), em);
    EXPECT_GT(max_abs(g.dmask), 0.0);
  }
}

}  // namespace

TEST(AttentionGrad, Plain) { check_gradients({"plain L=7 S=5 E=3 Ev=2", {2, 7, 3}, {2, 5, 3}, {2, 5, 2}, {}}); }

TEST(AttentionGrad, ScaleOverride) {
  check_gradients({"scale", {2, 7, 3}, {2, 5, 3}, {2, 5, 2}, {.scale = 1.3}});
}

TEST(AttentionGrad, BoolMasks) {
  Generator g(5);
  check_gradients({"bool full", {2, 3, 7, 3}, {2, 3, 5, 3}, {2, 3, 5, 2}, {.mask = rand_bool({2, 3, 7, 5}, g, 0.7)}});
  check_gradients({"bool key padding", {2, 3, 7, 3}, {2, 3, 5, 3}, {2, 3, 5, 2}, {.mask = rand_bool({2, 1, 1, 5}, g, 0.7)}});
}

TEST(AttentionGrad, FloatMaskAndItsGradient) {
  Generator g(6);
  check_gradients({"float full", {2, 7, 3}, {2, 5, 3}, {2, 5, 2}, {.mask = randn({2, 7, 5}, g)}, true});
  check_gradients({"float (L,S) broadcast over batch", {2, 3, 7, 3}, {2, 3, 5, 3}, {2, 3, 5, 2}, {.mask = randn({7, 5}, g)}, true});
  check_gradients({"float (H,1,S) broadcast over rows", {2, 3, 7, 3}, {2, 3, 5, 3}, {2, 3, 5, 2}, {.mask = randn({3, 1, 5}, g)}, true});
  Tensor with_inf = randn({7, 5}, g, 0, 1, DType::float64);
  with_inf.set_item({2, 1}, -INFINITY);
  with_inf.set_item({4, 4}, -INFINITY);
  AttentionOptions o{.mask = with_inf};
  // -inf entries: gradient 0 there, finite elsewhere (the difference check skips nothing: a -inf
  // entry moved by ±h stays -inf, so its numeric gradient is 0 too).
  Tensor q = random_tensor({7, 3}, 1), k = random_tensor({5, 3}, 2), v = random_tensor({5, 2}, 3);
  AttentionOutput fwd = attention_forward(q, k, v, o);
  AttentionGradients gr = attention_backward(random_tensor({7, 2}, 4), q, k, v, fwd, o, true);
  EXPECT_EQ(gr.dmask.item({2, 1}), 0.0);
  EXPECT_TRUE(all_finite(gr.dmask));
}

TEST(AttentionGrad, CausalAlignments) {
  check_gradients({"top-left L>S", {2, 7, 3}, {2, 5, 3}, {2, 5, 2}, {.causal = Causal::top_left}});
  check_gradients({"bottom-right L>S (empty rows)", {2, 7, 3}, {2, 5, 3}, {2, 5, 2}, {.causal = Causal::bottom_right}});
  check_gradients({"bottom-right L<S", {2, 3, 3}, {2, 5, 3}, {2, 5, 2}, {.causal = Causal::bottom_right}});
  Generator g(7);
  check_gradients({"causal + float mask", {2, 7, 3}, {2, 5, 3}, {2, 5, 2},
                   {.mask = randn({7, 5}, g), .causal = Causal::top_left}, true});
}

TEST(AttentionGrad, GroupedAndMultiQuery) {
  check_gradients({"GQA 6/2", {2, 6, 7, 3}, {2, 2, 5, 3}, {2, 2, 5, 2}, {}});
  check_gradients({"MQA 3/1 causal", {1, 3, 7, 3}, {1, 1, 5, 3}, {1, 1, 5, 2}, {.causal = Causal::bottom_right}});
}

TEST(AttentionGrad, BroadcastBatchDims) {
  check_gradients({"query broadcast over batch", {1, 2, 7, 3}, {3, 2, 5, 3}, {3, 2, 5, 2}, {}});
  check_gradients({"key/value broadcast", {3, 2, 7, 3}, {1, 2, 5, 3}, {2, 5, 2}, {}});
}

TEST(AttentionGrad, DropoutWithFixedSeed) {
  check_gradients({"dropout 0.3", {2, 2, 7, 3}, {2, 2, 5, 3}, {2, 2, 5, 2}, {.dropout_p = 0.3, .dropout_seed = 42}});
  Generator g(8);
  check_gradients({"dropout + mask + GQA", {2, 4, 7, 3}, {2, 2, 5, 3}, {2, 2, 5, 2},
                   {.mask = randn({4, 7, 5}, g), .causal = Causal::top_left, .dropout_p = 0.5, .dropout_seed = 1}, true});
}

TEST(AttentionGrad, SingleRowAndColumn) {
  check_gradients({"L=1", {2, 1, 3}, {2, 5, 3}, {2, 5, 2}, {}});
  check_gradients({"S=1", {2, 7, 3}, {2, 1, 3}, {2, 1, 2}, {}});
}

TEST(AttentionGrad, NonContiguousInputs) {
  Tensor q = random_tensor({2, 7, 2, 3}, 1).permute({0, 2, 1, 3});  // (2, 2, 7, 3) strided
  Tensor k = random_tensor({2, 2, 5, 6}, 2).slice(3, 0, 6, 2);      // E = 3, stride 2
  Tensor v = random_tensor({2, 2, 2, 5}, 3).transpose(2, 3);        // (2, 2, 5, 2)
  AttentionOptions o{.causal = Causal::top_left};
  AttentionOutput fwd = attention_forward(q, k, v, o);
  Tensor r = random_tensor(fwd.out.shape(), 4);
  AttentionGradients g = attention_backward(r, q, k, v, fwd, o);
  auto loss = [&] { return weighted_sum(attention_forward(q, k, v, o).out, r); };
  EXPECT_LT(gradient_error(q, g.dquery, loss), 1e-6);
  EXPECT_LT(gradient_error(k, g.dkey, loss), 1e-6);
  EXPECT_LT(gradient_error(v, g.dvalue, loss), 1e-6);
}

// A loss on the returned weights as well as the output: d(Σ out∘R + Σ W∘G)
// against central differences, with masks, causality, GQA, broadcast batch
// dims and dropout (W holds the dropout factors), and with the loss on W only.
TEST(AttentionGrad, ThroughTheReturnedWeights) {
  std::vector<bool> allowed;
  for (int64_t i = 0; i < 6 * 5; ++i) allowed.push_back(i % 4 != 1 && i / 5 != 2);  // row 2 fully masked
  const std::vector<GradCase> cases{
      {"plain", {2, 6, 3}, {2, 5, 3}, {2, 5, 2}, {}},
      {"bool mask, a fully masked row", {2, 6, 3}, {2, 5, 3}, {2, 5, 2}, {.mask = Tensor::from_bools(allowed, {6, 5})}},
      {"causal bottom-right, window", {1, 2, 6, 3}, {1, 2, 5, 3}, {1, 2, 5, 2},
       {.causal = Causal::bottom_right, .window_left = 2}},
      {"gqa, broadcast batch", {2, 4, 6, 3}, {1, 2, 5, 3}, {1, 2, 5, 2}, {}},
      {"dropout", {2, 6, 3}, {2, 5, 3}, {2, 5, 2}, {.dropout_p = 0.3, .dropout_seed = 9}},
  };
  for (bool with_out : {true, false})
    for (const GradCase& c : cases) {
      SCOPED_TRACE(c.name + (with_out ? "" : ", loss on the weights only"));
      Tensor q = random_tensor(c.q, 21), k = random_tensor(c.k, 22), v = random_tensor(c.v, 23);
      AttentionOptions o = c.options;
      o.return_weights = true;
      const AttentionOutput fwd = attention_forward(q, k, v, o);
      const Tensor r = with_out ? random_tensor(fwd.out.shape(), 24) : Tensor::zeros(fwd.out.shape(), DType::float64);
      const Tensor gw = random_tensor(fwd.weights.shape(), 25);
      const AttentionGradients g = attention_backward(r, q, k, v, fwd, o, false, gw);
      auto loss = [&] {
        const AttentionOutput f = attention_forward(q, k, v, o);
        return weighted_sum(f.out, r) + weighted_sum(f.weights, gw);
      };
      EXPECT_LT(gradient_error(q, g.dquery, loss), 1e-6) << "dquery";
      EXPECT_LT(gradient_error(k, g.dkey, loss), 1e-6) << "dkey";
      EXPECT_LT(gradient_error(v, g.dvalue, loss), 1e-6) << "dvalue";
      EXPECT_GT(max_abs(g.dquery), 0.0);
      if (!with_out) {
        EXPECT_EQ(max_abs(g.dvalue), 0.0);  // the weights do not depend on v
      }
    }
}

// float32 through the automatic path (the fused backward) against float64.
TEST(AttentionGrad, ThroughTheReturnedWeightsInFloat32) {
  const Tensor q = random_tensor({2, 2, 9, 4}, 31, DType::float32), k = random_tensor({2, 2, 11, 4}, 32, DType::float32),
               v = random_tensor({2, 2, 11, 3}, 33, DType::float32);
  AttentionOptions o{.causal = Causal::bottom_right, .return_weights = true};
  const AttentionOutput f = attention_forward(q, k, v, o);
  const Tensor r = random_tensor(f.out.shape(), 34, DType::float32), gw = random_tensor(f.weights.shape(), 35, DType::float32);
  const AttentionGradients got = attention_backward(r, q, k, v, f, o, false, gw);
  AttentionOptions o64 = o;
  const AttentionOutput f64 = attention_forward(q.to(DType::float64), k.to(DType::float64), v.to(DType::float64), o64);
  const AttentionGradients want = attention_backward(r.to(DType::float64), q.to(DType::float64), k.to(DType::float64),
                                                     v.to(DType::float64), f64, o64, false, gw.to(DType::float64));
  EXPECT_LT(max_abs_diff(got.dquery.to(DType::float64), want.dquery), 1e-5);
  EXPECT_LT(max_abs_diff(got.dkey.to(DType::float64), want.dkey), 1e-5);
  EXPECT_LT(max_abs_diff(got.dvalue.to(DType::float64), want.dvalue), 1e-5);
  EXPECT_EQ(f.path, AttentionPath::fused);  // the automatic path: the fused backward adds the weights' share
  expect_error<ShapeError>([&] { attention_backward(r, q, k, v, f, {}, false, gw.slice(-1, 0, 5)); }, "dweights");
  expect_error<DtypeError>([&] { attention_backward(r, q, k, v, f, {}, false, gw.to(DType::float64)); }, "dweights");
}
