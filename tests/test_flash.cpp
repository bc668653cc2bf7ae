// The fused path against the reference path, on every instruction set this
// CPU supports (each forced in turn): odd sizes, every mask kind, both causal
// alignments, windows, GQA, dropout, fully masked rows, bfloat16; forward,
// weights and backward. Plus the accuracy rule: the fused float32 error
// against float64 stays within 2× the reference path's float32 error.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <cstdio>
#include <limits>
#include <thread>
#include <tuple>

#include "cpu/flash/dispatch.h"
#include "cpu/gemm.h"
#include "cpu/scratch.h"
#include "mha/memory.h"
#include "mha/nn/multihead_attention.h"
#include "testing.h"

using namespace mha;
using namespace mha::testing;

namespace {

Shape with_tail(Shape s, int64_t last) {
  s.back() = last;
  return s;
}

struct FlashCase {
  std::string name;
  Shape q, k, v;
  AttentionOptions options;
};

// Forces each instruction set in turn for the life of the object.
class EachIsa : public ::testing::TestWithParam<cpu::Isa> {
 protected:
  void SetUp() override { cpu::force_isa(GetParam()); }
  void TearDown() override { cpu::force_isa(std::nullopt); }
};

std::string isa_name(const ::testing::TestParamInfo<cpu::Isa>& info) { return cpu::to_string(info.param); }

// Fused and reference results on the same float32 (or bf16) inputs; the
// tolerance is relative to the output's size.
void compare(const FlashCase& c, DType dtype, bool backward) {
  SCOPED_TRACE(c.name + " " + to_string(dtype) + " on " + cpu::to_string(cpu::active_isa()));
  Tensor q = random_tensor(c.q, 1, dtype), k = random_tensor(c.k, 2, dtype), v = random_tensor(c.v, 3, dtype);
  AttentionOptions fused = c.options, reference = c.options;
  fused.path = AttentionPath::fused;
  reference.path = AttentionPath::reference;
  fused.return_weights = reference.return_weights = !backward;
  AttentionOutput a = attention_forward(q, k, v, fused), b = attention_forward(q, k, v, reference);
  ASSERT_EQ(a.path, AttentionPath::fused);
  const double tol = dtype == DType::bfloat16 ? 2e-2 : 2e-5;
  EXPECT_LE(max_abs_diff(a.out, b.out), tol * std::max(1.0, max_abs(b.out)));
  std::vector<double> la = a.lse.to_vector(), lb = b.lse.to_vector();
  for (size_t i = 0; i < la.size(); ++i) {
    if (std::isinf(lb[i])) ASSERT_EQ(la[i], lb[i]) << "row " << i;
    else ASSERT_NEAR(la[i], lb[i], 1e-4 * std::max(1.0, std::abs(lb[i]))) << "row " << i;
  }
  EXPECT_TRUE(all_finite(a.out));
  if (!backward) {
    EXPECT_LE(max_abs_diff(a.weights, b.weights), dtype == DType::bfloat16 ? 1e-2 : 1e-5);
    return;
  }
  Tensor dout = random_tensor(b.out.shape(), 4, dtype);
  AttentionGradients ga = attention_backward(dout, q, k, v, a, fused), gb = attention_backward(dout, q, k, v, b, reference);
  for (auto [x, y, name] : {std::tuple{&ga.dquery, &gb.dquery, "dquery"}, {&ga.dkey, &gb.dkey, "dkey"},
                            {&ga.dvalue, &gb.dvalue, "dvalue"}}) {
    EXPECT_TRUE(all_finite(*x)) << name;
    EXPECT_LE(max_abs_diff(*x, *y), 5 * tol * std::max(1.0, max_abs(*y))) << name;
  }
}

std::vector<FlashCase> shape_cases() {
  std::vector<FlashCase> cs;
  for (int64_t E : {1, 3, 59, 64, 80, 128, 256}) {
    const int64_t L = E == 64 ? 65 : 17 + E % 5, S = E == 64 ? 63 : 64 + E % 3;
    cs.push_back({"E=" + std::to_string(E), {2, L, E}, {2, S, E}, {2, S, E == 1 ? 3 : E}, {}});
  }
  for (int64_t L : {1, 17, 63, 64, 65, 1025})
    for (int64_t S : {1, 17, 63, 64, 65, 1025}) {
      if (L * S > 70000 && !(L == 1025 && S == 1025)) continue;
      cs.push_back({"L=" + std::to_string(L) + " S=" + std::to_string(S), {1, 2, L, 8}, {1, 2, S, 8}, {1, 2, S, 5},
                    {.causal = (L + S) % 2 ? Causal::top_left : Causal::bottom_right}});
    }
  return cs;
}

std::vector<FlashCase> feature_cases() {
  std::vector<FlashCase> cs;
  const Shape q{2, 3, 70, 16}, k{2, 3, 67, 16}, v{2, 3, 67, 12};
  Generator g(11);
  cs.push_back({"bool mask full", q, k, v, {.mask = rand_bool({2, 3, 70, 67}, g, 0.7)}});
  cs.push_back({"bool key padding", q, k, v, {.mask = rand_bool({2, 1, 1, 67}, g, 0.8)}});
  cs.push_back({"float mask (H,1,S)", q, k, v, {.mask = randn({3, 1, 67}, g)}});
  cs.push_back({"float mask (L,S) with -inf", q, k, v, {.mask = rand_bool({70, 67}, g, 0.9).to(DType::float32)}});
  cs.push_back({"causal top-left", q, k, v, {.causal = Causal::top_left}});
  cs.push_back({"causal bottom-right", q, k, v, {.causal = Causal::bottom_right}});
  cs.push_back({"causal bottom-right L<S", {2, 3, 20, 16}, k, v, {.causal = Causal::bottom_right}});
  cs.push_back({"window (5, 3)", q, k, v, {.window_left = 5, .window_right = 3}});
  cs.push_back({"window (0, 0)", q, k, v, {.window_left = 0, .window_right = 0}});
  cs.push_back({"causal window 16", {1, 2, 300, 16}, {1, 2, 300, 16}, {1, 2, 300, 8},
                {.causal = Causal::top_left, .window_left = 16}});
  cs.push_back({"right window only", q, k, v, {.window_right = 2}});
  cs.push_back({"GQA 6/2 + mask", {2, 6, 33, 16}, {2, 2, 40, 16}, {2, 2, 40, 8}, {.mask = randn({33, 40}, g)}});
  cs.push_back({"MQA broadcast batch", {3, 4, 33, 16}, {1, 1, 40, 16}, {1, 1, 40, 8}, {.causal = Causal::bottom_right}});
  cs.push_back({"dropout", q, k, v, {.dropout_p = 0.3, .dropout_seed = 7}});
  cs.push_back({"dropout + causal + GQA", {2, 4, 40, 16}, {2, 2, 40, 16}, {2, 2, 40, 8},
                {.causal = Causal::top_left, .dropout_p = 0.5, .dropout_seed = 3}});
  cs.push_back({"scale", q, k, v, {.scale = 0.03}});
  // Rows 3..9 of every head see no key.
  Tensor rows_masked = Tensor::full({70, 67}, 1.0, DType::boolean);
  for (int64_t i = 3; i < 10; ++i) rows_masked.select(0, i).fill_(0.0);
  cs.push_back({"fully masked rows", q, k, v, {.mask = rows_masked}});
  cs.push_back({"bottom-right L>S: empty rows", {1, 2, 90, 16}, {1, 2, 40, 16}, {1, 2, 40, 8}, {.causal = Causal::bottom_right}});
  return cs;
}

}  // namespace

TEST_P(EachIsa, OddShapesForward) {
  for (const FlashCase& c : shape_cases()) compare(c, DType::float32, false);
}

TEST_P(EachIsa, OddShapesBackward) {
  for (const FlashCase& c : shape_cases()) compare(c, DType::float32, true);
}

TEST_P(EachIsa, FeaturesForwardAndBackward) {
  for (const FlashCase& c : feature_cases()) {
    compare(c, DType::float32, false);
    compare(c, DType::float32, true);
  }
}

// Each bfloat16 case on every kind of product the CPU has: vdpbf16ps (where
// it has AVX512-BF16 and runs avx512), AMX tiles for the products around the
// kernel and float32 products of the widened values.
template <class F>
void on_each_bf16_kernel(F&& f) {
  for (cpu::Bf16Products kind : cpu::supported_bf16_products()) {
    cpu::force_bf16_products(kind);
    SCOPED_TRACE("bfloat16 products: " + cpu::to_string(kind));
    f();
  }
  cpu::force_bf16_products(std::nullopt);
}

TEST_P(EachIsa, Bfloat16) {
  on_each_bf16_kernel([] {
    for (const FlashCase& c : feature_cases()) compare(c, DType::bfloat16, true);
    for (const FlashCase& c : shape_cases()) compare(c, DType::bfloat16, true);
    compare({"E=64 L=S=130", {2, 130, 64}, {2, 130, 64}, {2, 130, 64}, {}}, DType::bfloat16, false);
  });
}

// A loss on the returned weights too (dweights): the fused backward adds their
// share through a recomputed P and two products per tile; against the
// reference path's, with the loss on the output and the weights, and on the
// weights alone.
void compare_weights_gradient(const FlashCase& c, DType dtype) {
  SCOPED_TRACE(c.name + " " + to_string(dtype) + " on " + cpu::to_string(cpu::active_isa()));
  Tensor q = random_tensor(c.q, 1, dtype), k = random_tensor(c.k, 2, dtype), v = random_tensor(c.v, 3, dtype);
  AttentionOptions fused = c.options, reference = c.options;
  fused.path = AttentionPath::fused, reference.path = AttentionPath::reference;
  fused.return_weights = reference.return_weights = true;
  const AttentionOutput a = attention_forward(q, k, v, fused), b = attention_forward(q, k, v, reference);
  const Tensor dw = random_tensor(b.weights.shape(), 5, dtype);
  const double tol = dtype == DType::bfloat16 ? 1e-1 : 1e-4;
  for (bool with_out : {true, false}) {
    SCOPED_TRACE(with_out ? "loss on out and weights" : "loss on the weights alone");
    const Tensor dout = with_out ? random_tensor(b.out.shape(), 4, dtype) : Tensor::zeros(b.out.shape(), dtype);
    const AttentionGradients ga = attention_backward(dout, q, k, v, a, fused, false, dw);
    const AttentionGradients gb = attention_backward(dout, q, k, v, b, reference, false, dw);
    for (auto [x, y, name] : {std::tuple{&ga.dquery, &gb.dquery, "dquery"}, {&ga.dkey, &gb.dkey, "dkey"},
                              {&ga.dvalue, &gb.dvalue, "dvalue"}}) {
      EXPECT_TRUE(all_finite(*x)) << name;
      EXPECT_LE(max_abs_diff(*x, *y), tol * std::max(1.0, max_abs(*y))) << name;
    }
    // Not all zeros where the reference's is not (one visible key a row: weights 1, no gradient).
    if (max_abs(gb.dquery) > 1e-3) {
      EXPECT_GT(max_abs(ga.dquery), 0.0);
    }
  }
}

TEST_P(EachIsa, ThroughTheReturnedWeights) {
  for (const FlashCase& c : feature_cases()) compare_weights_gradient(c, DType::float32);
  for (const FlashCase& c : shape_cases())
    if (c.q.back() <= 64 && c.q[c.q.size() - 2] * c.k[c.k.size() - 2] < 5000) compare_weights_gradient(c, DType::float32);
  compare_weights_gradient({"L=130 S=200 (tiles of both kinds)", {3, 130, 24}, {3, 200, 24}, {3, 200, 8},
                            {.causal = Causal::bottom_right, .window_left = 90}},
                           DType::float32);
  on_each_bf16_kernel([] {
    compare_weights_gradient({"bf16 GQA + dropout", {2, 4, 40, 16}, {2, 2, 40, 16}, {2, 2, 40, 8},
                              {.causal = Causal::top_left, .dropout_p = 0.3, .dropout_seed = 3}},
                             DType::bfloat16);
  });
}

// A probability below FLT_MIN comes out exactly 0, never subnormal (a
// subnormal result costs a microcode assist per lane: the masked half of a
// causal tile took 70% of the backward's time at L = 43). Logits 0, -2.5, -5,
// …: e^-85 (key 34) is normal, e^-87.5 (key 35) is below FLT_MIN.
TEST_P(EachIsa, ProbabilitiesBelowTheNormalRangeAreZero) {
  const int64_t L = 3, S = 40;
  std::vector<double> mask(size_t(L * S));
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < S; ++j) mask[size_t(i * S + j)] = -2.5 * double(j);
  const AttentionOptions o{.mask = Tensor::from_values(mask, {L, S}), .return_weights = true,
                           .path = AttentionPath::fused};
  const AttentionOutput a = attention_forward(Tensor::zeros({1, L, 16}), Tensor::zeros({1, S, 16}),
                                              random_tensor({1, S, 8}, 3, DType::float32), o);
  ASSERT_EQ(a.path, AttentionPath::fused);
  double z = 0;
  for (int64_t j = 0; j < S; ++j) z += std::exp(-2.5 * double(j));
  const std::vector<double> w = a.weights.to_vector();
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < S; ++j) {
      const double got = w[size_t(i * S + j)];
      if (j <= 34) {
        EXPECT_GE(got, double(std::numeric_limits<float>::min())) << "key " << j;
        EXPECT_NEAR(got, std::exp(-2.5 * double(j)) / z, 2e-5 * std::exp(-2.5 * double(j)) / z) << "key " << j;
      } else {
        EXPECT_EQ(got, 0.0) << "key " << j;
      }
    }
}

// Logits from 1e3 to 1e8 (q and k entries of -30 to -3e4, as the fuzzer plants
// -1e4): the softmax is one-hot on key 0, so the weights are (1, 0, 0) and
// dV[0] = Σ_i dO_i, dV[1] = dV[2] = 0. The fused path recovers P from the saved
// float32 lse, exact only to an exponent error of about ε·|lse2| (kernel.h,
// probability): P stays within 2^(2ε|lse2|) - 1 of 1, and never above 1 (it
// came out 2^8 at 1e8, 0.73 at 3.6e7 before P was held to its range and the
// logit rounded as the forward rounds it).
TEST_P(EachIsa, HugeLogitsKeepProbabilitiesInRange) {
  // L = 4: by query tiles on avx2 and scalar, by rows on avx512 (few queries); L = 1: by rows on every ISA.
  for (const int64_t L : {4, 1}) {
  SCOPED_TRACE("L " + std::to_string(L));
  const int64_t S = 3, Ev = 7;
  const Tensor v = random_tensor({1, S, Ev}, 3, DType::float32), dout = random_tensor({1, L, Ev}, 4, DType::float32);
  const std::vector<double> d = dout.to_vector();
  int64_t rows = 0, exact = 0;
  for (double big = 30; big < 3e4; big *= 1.1)
    for (const int64_t E : {2, 16, 33})
      for (const bool with_mask : {false, true}) {
        SCOPED_TRACE("q, k entries -" + std::to_string(big) + ", E " + std::to_string(E) + (with_mask ? ", a float mask" : ""));
        Tensor q = random_tensor({1, L, E}, 1, DType::float32), k = random_tensor({1, S, E}, 2, DType::float32);
        for (int64_t i = 0; i < L; ++i) q.set_item({0, i, 0}, -big);
        k.set_item({0, 0, 0}, -big);
        AttentionOptions o{.return_weights = true, .path = AttentionPath::fused};
        if (with_mask) o.mask = random_tensor({L, S}, 5, DType::float32);
        const AttentionOutput a = attention_forward(q, k, v, o);
        ASSERT_EQ(a.path, AttentionPath::fused);
        const std::vector<double> w = a.weights.to_vector(), lse = a.lse.to_vector();
        double bound = 0;
        for (int64_t i = 0; i < L; ++i) {
          const double within = std::min(1.0, std::exp2(2 * 0x1p-24 * std::abs(lse[size_t(i)]) * M_LOG2E) - 1);
          bound = std::max(bound, within);
          const double p = w[size_t(i * S)];
          ASSERT_LE(p, 1.0) << "row " << i;
          ASSERT_GE(p, 1.0 - within) << "row " << i << ", lse " << lse[size_t(i)];
          ASSERT_EQ(w[size_t(i * S + 1)], 0.0) << "row " << i;
          ASSERT_EQ(w[size_t(i * S + 2)], 0.0) << "row " << i;
          ++rows, exact += p == 1.0;
        }
        o.return_weights = false;
        const AttentionGradients g = attention_backward(dout, q, k, v, attention_forward(q, k, v, o), o);
        const std::vector<double> dv = g.dvalue.to_vector();
        for (int64_t e = 0; e < Ev; ++e) {
          double sum = 0, size = 0;
          for (int64_t i = 0; i < L; ++i) sum += d[size_t(i * Ev + e)], size += std::abs(d[size_t(i * Ev + e)]);
          ASSERT_NEAR(dv[size_t(e)], sum, bound * size + 1e-5) << "dvalue[0][" << e << "]";
          ASSERT_EQ(dv[size_t(Ev + e)], 0.0) << "dvalue[1][" << e << "]";
        }
        ASSERT_TRUE(all_finite(g.dquery));
        ASSERT_TRUE(all_finite(g.dkey));
      }
  // Most one-hot rows come out exactly 1 (the rounded logit): 2829 of 6096 did not, fused.
  EXPECT_GE(exact, rows * 9 / 10) << exact << " of " << rows << " rows gave P = 1 exactly";
  }
}

// Few queries (decoding: one a step) go by rows instead of query tiles where
// a tile would leave three quarters of its lanes idle (4·L ≤ the vector
// width: L ≤ 4 on avx512, ≤ 2 on avx2 and scalar; dispatch.cpp), forward and
// backward; with dropout they go by tiles. Against the reference path.
TEST_P(EachIsa, FewQueriesByRows) {
  Generator g(12);
  for (const int64_t L : {1, 2, 3, 4}) {
    const Shape q{2, 3, L, 17}, k{2, 3, 45, 17}, v{2, 3, 45, 9};
    Tensor masked_row = Tensor::full({L, 45}, 1.0, DType::boolean);
    masked_row.select(0, 0).fill_(0.0);  // row 0 sees no key
    std::vector<FlashCase> cases{
        {"plain", q, k, v, {}},
        {"causal bottom-right", q, k, v, {.causal = Causal::bottom_right}},
        {"causal top-left", q, k, v, {.causal = Causal::top_left}},
        {"window (6, 2) bottom-right", q, k, v, {.causal = Causal::bottom_right, .window_left = 6}},
        {"window (0, 3)", q, k, v, {.window_left = 0, .window_right = 3}},
        {"float mask with -inf", q, k, v, {.mask = rand_bool({L, 45}, g, 0.8).to(DType::float32)}},
        {"bool key padding", q, k, v, {.mask = rand_bool({2, 1, 1, 45}, g, 0.7)}},
        {"float mask (B,H,L,S)", q, k, v, {.mask = randn({2, 3, L, 45}, g)}},
        {"a row with no key", q, k, v, {.mask = masked_row}},
        {"GQA 6/2", {2, 6, L, 16}, {2, 2, 50, 16}, {2, 2, 50, 33}, {.causal = Causal::bottom_right}},
        {"E 1, Ev 64", {1, 2, L, 1}, {1, 2, 70, 1}, {1, 2, 70, 64}, {}},
        {"E 130", {1, 2, L, 130}, {1, 2, 20, 130}, {1, 2, 20, 3}, {}},
        // The output by 8, 4, 2 and 1 whole vectors and a partial one (AVX2; AVX-512: 4, 2, 1 and one).
        {"Ev 127", {1, 2, L, 16}, {1, 2, 30, 16}, {1, 2, 30, 127}, {.causal = Causal::bottom_right}},
        {"one key", {1, 2, L, 8}, {1, 2, 1, 8}, {1, 2, 1, 8}, {}},
        // Bands that leave rows no key, lying past the keys' start (the differential sweep's case 5582).
        {"window (-1, 0), S 1", {1, 3, L, 23}, {1, 3, 1, 23}, {1, 3, 1, 27}, {.window_right = 0}},
        {"causal bottom-right, S 2", {1, 2, L, 8}, {1, 2, 2, 8}, {1, 2, 2, 8}, {.causal = Causal::bottom_right}},
        {"window (1, -1) bottom-right, S 9", {1, 2, L, 8}, {1, 2, 9, 8}, {1, 2, 9, 8},
         {.causal = Causal::bottom_right, .window_left = 1}},
        {"scale", q, k, v, {.scale = 0.03}},
    };
    for (const FlashCase& c : cases) {
      compare(c, DType::float32, true);
      compare(c, DType::bfloat16, true);
    }
  }
}

// Strided rows, as the heads of an (N, L, H·E) tensor (the forward copies key
// and value rows lying apart together when several query tiles read them, the
// backward query, dO and key rows), for several entries and for one (the
// backward then splits the entry over threads).
TEST_P(EachIsa, NonContiguousInputs) {
  const auto check = [](const Tensor& q, const Tensor& k, const Tensor& v) {
    AttentionOptions o{.causal = Causal::top_left, .path = AttentionPath::fused};
    AttentionOutput a = attention_forward(q, k, v, o);
    AttentionOptions r = o;
    r.path = AttentionPath::reference;
    AttentionOutput b = attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), r);
    EXPECT_LE(max_abs_diff(a.out, b.out), 2e-5);
    Tensor dout = random_tensor(a.out.shape(), 4, DType::float32).transpose(0, 1).contiguous().transpose(0, 1);
    AttentionGradients ga = attention_backward(dout, q, k, v, a, o);
    AttentionGradients gb = attention_backward(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), b, r);
    EXPECT_LE(max_abs_diff(ga.dquery, gb.dquery), 1e-4);
    EXPECT_LE(max_abs_diff(ga.dkey, gb.dkey), 1e-4);
    EXPECT_LE(max_abs_diff(ga.dvalue, gb.dvalue), 1e-4);
  };
  check(random_tensor({2, 70, 3, 16}, 1, DType::float32).permute({0, 2, 1, 3}),
        random_tensor({2, 3, 16, 67}, 2, DType::float32).transpose(2, 3),  // element stride 67
        random_tensor({2, 3, 67, 24}, 3, DType::float32).slice(3, 0, 24, 2));
  const auto head = [](Shape shape, uint64_t seed) {  // (1, 1, R, E) of an (1, R, 2·E) tensor
    return random_tensor(shape, seed, DType::float32).permute({0, 2, 1, 3}).slice(1, 1, 2);
  };
  check(head({1, 150, 2, 32}, 5), head({1, 140, 2, 32}, 6), head({1, 140, 2, 32}, 7));
}

// attention_forward_into and attention_backward_into write into views whose
// rows lie apart (heads of (N, L, slots·E) buffers, one slot left over that
// must keep its sentinel): the same values as the allocating calls, bit for
// bit, on the fused tile and by-rows paths, through the reference path
// (float64, and a NaN that sends the fused call there), and with grouped keys
// whose gradients are summed (no direct rows). Bad outputs get typed errors.
TEST_P(EachIsa, IntoViews) {
  constexpr double kSentinel = 7.25;
  // An (N, H, R, E) view of an (N, R, H + 1, E) buffer of sentinels.
  const auto heads = [](int64_t N, int64_t H, int64_t R, int64_t E, DType dtype) {
    Tensor buffer = Tensor::empty({N, R, H + 1, E}, dtype);
    buffer.fill_(kSentinel);
    return std::pair{buffer, buffer.slice(2, 0, H).permute({0, 2, 1, 3})};
  };
  const auto untouched = [](const Tensor& buffer) {  // the leftover slot
    for (double x : buffer.select(2, buffer.size(2) - 1).to_vector())
      if (x != kSentinel) return false;
    return true;
  };
  const auto same = [](const Tensor& a, const Tensor& b) {  // bit for bit, NaN where NaN
    const std::vector<double> x = a.to_vector(), y = b.to_vector();
    EXPECT_EQ(x.size(), y.size());
    for (size_t i = 0; i < x.size(); ++i)
      if (!(x[i] == y[i] || (std::isnan(x[i]) && std::isnan(y[i])))) return false;
    return true;
  };
  struct Case {
    const char* name;
    DType dtype;
    int64_t L, S, kv_heads;
    bool nan;
  };
  for (const Case c : {Case{"tiles", DType::float32, 70, 67, 3, false}, Case{"rows", DType::float32, 2, 40, 3, false},
                       Case{"bfloat16", DType::bfloat16, 70, 67, 3, false}, Case{"grouped", DType::float32, 33, 45, 1, false},
                       Case{"float64", DType::float64, 21, 19, 3, false}, Case{"nan", DType::float32, 37, 37, 3, true}}) {
    SCOPED_TRACE(std::string(c.name) + " on " + cpu::to_string(cpu::active_isa()));
    const int64_t N = 2, H = 3, E = 16;
    Tensor q = random_tensor({N, H, c.L, E}, 1, c.dtype), k = random_tensor({N, c.kv_heads, c.S, E}, 2, c.dtype),
           v = random_tensor({N, c.kv_heads, c.S, E}, 3, c.dtype), dout = random_tensor({N, H, c.L, E}, 4, c.dtype);
    if (c.nan) q.set_item({1, 2, 5, 3}, std::nan(""));
    const AttentionOptions o{.causal = Causal::bottom_right};
    const AttentionOutput want = attention_forward(q, k, v, o);
    auto [out_buffer, out] = heads(N, H, c.L, E, c.dtype);
    const AttentionOutput got = attention_forward_into(out, q, k, v, o);
    EXPECT_TRUE(same(got.out, want.out));
    EXPECT_TRUE(same(out, want.out));
    EXPECT_TRUE(untouched(out_buffer));
    EXPECT_EQ(got.path, want.path);
    const AttentionGradients g = attention_backward(dout, q, k, v, want, o);
    auto [dq_buffer, dq] = heads(N, H, c.L, E, c.dtype);
    auto [dk_buffer, dk] = heads(N, c.kv_heads, c.S, E, c.dtype);
    auto [dv_buffer, dv] = heads(N, c.kv_heads, c.S, E, c.dtype);
    AttentionGradients into{.dquery = dq, .dkey = dk, .dvalue = dv};
    attention_backward_into(into, dout, q, k, v, got, o);  // the forward's out is the view
    EXPECT_TRUE(same(dq, g.dquery));
    EXPECT_TRUE(same(dk, g.dkey));
    EXPECT_TRUE(same(dv, g.dvalue));
    for (const Tensor* b : {&dq_buffer, &dk_buffer, &dv_buffer}) EXPECT_TRUE(untouched(*b));
  }
  const Tensor q = random_tensor({1, 2, 5, 8}, 1, DType::float32);
  EXPECT_THROW(attention_forward_into(Tensor::empty({1, 2, 5, 7}, DType::float32), q, q, q), ShapeError);
  EXPECT_THROW(attention_forward_into(Tensor::empty({1, 2, 5, 8}, DType::float64), q, q, q), DtypeError);
  EXPECT_THROW(attention_forward_into(Tensor::empty({1, 2, 8, 5}, DType::float32).transpose(2, 3), q, q, q), ValueError);
  const AttentionOutput f = attention_forward(q, q, q);
  AttentionGradients missing{.dquery = Tensor::empty({1, 2, 5, 8}, DType::float32)};
  EXPECT_THROW(attention_backward_into(missing, q, q, q, q, f), ShapeError);
}

// Max error against float64 ground truth of out, dq, dk, dv: the fused path in
// `dtype` must stay within 2× the reference path in `dtype` (which rounds
// only its results), the gradients within `gradient_factor` ×, on the same
// (dtype-rounded) inputs, at a size where rounding dominates.
static void expect_error_within(double gradient_factor, DType dtype, Causal causal, cpu::Isa isa) {
  Tensor q = random_tensor({2, 4, 257, 64}, 1, dtype), k = random_tensor({2, 4, 250, 64}, 2, dtype),
         v = random_tensor({2, 4, 250, 64}, 3, dtype), dout = random_tensor({2, 4, 257, 64}, 4, dtype);
  auto run = [&](DType as, AttentionPath path) {
    AttentionOptions o{.causal = causal, .path = path};
    Tensor qc = q.to(as), kc = k.to(as), vc = v.to(as), dc = dout.to(as);
    AttentionOutput f = attention_forward(qc, kc, vc, o);
    AttentionGradients g = attention_backward(dc, qc, kc, vc, f, o);
    return std::vector<Tensor>{f.out, g.dquery, g.dkey, g.dvalue};
  };
  std::vector<Tensor> truth = run(DType::float64, AttentionPath::reference), ref = run(dtype, AttentionPath::reference),
                      fused = run(dtype, AttentionPath::fused);
  const char* names[] = {"out", "dquery", "dkey", "dvalue"};
  for (size_t i = 0; i < truth.size(); ++i) {
    const double e_ref = max_abs_diff(ref[i], truth[i]), e_fused = max_abs_diff(fused[i], truth[i]);
    EXPECT_LE(e_fused, (i == 0 ? 2 : gradient_factor) * e_ref) << names[i];
    std::printf("  %-7s %-8s %-6s error vs float64: reference %.2e, fused %.2e (%.2fx)\n", cpu::to_string(isa).c_str(),
                to_string(dtype).c_str(), names[i], e_ref, e_fused, e_fused / e_ref);
  }
}

TEST_P(EachIsa, ErrorWithinTwiceTheReferenceError) {
  expect_error_within(2, DType::float32, Causal::bottom_right, GetParam());
}

TEST_P(EachIsa, Bfloat16ErrorWithinTwiceTheReferenceError) {
  // Every bf16 path rounds its results to bf16. The vdpbf16ps and AMX
  // kernels also round P (forward and backward) and dS (backward) to bf16
  // before their products, each a relative error of up to 2^-9 per term, the
  // size of the results' own rounding: their gradients get 3× (measured at
  // this size, both kernels: dQ 2.07×, dV 1.48×, dK 1.13×), their output 2×
  // (1.20×).
  on_each_bf16_kernel([&] {
    const bool rounds_ds = cpu::bf16_products() != cpu::Bf16Products::widen && GetParam() == cpu::Isa::avx512;
    expect_error_within(rounds_ds ? 3 : 2, DType::bfloat16, Causal::top_left, GetParam());
  });
}

TEST_P(EachIsa, Bfloat16NonContiguousAndDeterministic) {
  // Strided bfloat16 inputs (the kernel's pairs are copies then), on every
  // kind of product; one entry runs whole on one thread and split into key
  // and query tiles on two: the same bits.
  Tensor q = random_tensor({1, 70, 3, 17}, 1, DType::bfloat16).permute({0, 2, 1, 3});
  Tensor k = random_tensor({1, 3, 17, 67}, 2, DType::bfloat16).transpose(2, 3);
  Tensor v = random_tensor({1, 3, 67, 26}, 3, DType::bfloat16).slice(3, 0, 26, 2);
  const Tensor dout = random_tensor({1, 3, 70, 13}, 4, DType::bfloat16).transpose(2, 3).contiguous().transpose(2, 3);
  on_each_bf16_kernel([&] {
    AttentionOptions o{.causal = Causal::top_left, .dropout_p = 0.2, .dropout_seed = 5, .path = AttentionPath::fused};
    const int saved = omp_get_max_threads();
    std::vector<double> results[2];
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      for (int64_t h = 0; h < 3; ++h) {  // one head at a time: one entry
        const auto head = [&](const Tensor& t) { return t.slice(1, h, h + 1); };
        const AttentionOutput f = attention_forward(head(q), head(k), head(v), o);
        const AttentionGradients g = attention_backward(head(dout), head(q), head(k), head(v), f, o);
        for (const Tensor* t : {&f.out, &g.dquery, &g.dkey, &g.dvalue}) {
          const std::vector<double> x = t->to_vector();
          results[threads - 1].insert(results[threads - 1].end(), x.begin(), x.end());
        }
      }
    }
    omp_set_num_threads(saved);
    EXPECT_EQ(results[0], results[1]);
    AttentionOptions r = o;
    r.path = AttentionPath::reference;
    const AttentionOutput a = attention_forward(q, k, v, o), b = attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), r);
    const AttentionGradients ga = attention_backward(dout, q, k, v, a, o);
    const AttentionGradients gb = attention_backward(dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), b, r);
    EXPECT_LE(max_abs_diff(a.out, b.out), 2e-2 * std::max(1.0, max_abs(b.out)));
    for (auto [x, y, name] : {std::tuple{&ga.dquery, &gb.dquery, "dquery"}, {&ga.dkey, &gb.dkey, "dkey"},
                              {&ga.dvalue, &gb.dvalue, "dvalue"}})
      EXPECT_LE(max_abs_diff(*x, *y), 0.1 * std::max(1.0, max_abs(*y))) << name;
  });
}

TEST_P(EachIsa, Bfloat16DropoutPadLanesIgnoreStaleScratch) {
  // L = 37: the last query tile has pad lanes, which the bfloat16 kernels'
  // products reduce over (pairs, whole steps of 32). Their dropout factors
  // must be 0 whatever the thread's scratch held: run once on a fresh thread,
  // once with NaN in every float of this thread's kernel scratch; the same
  // bits (a stale -inf or NaN there made P∘F NaN, and the call fell back to
  // the reference path: the allocation-failure sweep found it).
  const Tensor q = random_tensor({1, 2, 37, 10}, 1, DType::bfloat16), k = random_tensor({1, 2, 45, 10}, 2, DType::bfloat16),
               v = random_tensor({1, 2, 45, 5}, 3, DType::bfloat16), dout = random_tensor({1, 2, 37, 5}, 4, DType::bfloat16);
  const AttentionOptions o{.causal = Causal::bottom_right, .dropout_p = 0.2, .dropout_seed = 3, .path = AttentionPath::fused};
  const auto gradients = [&] {
    const AttentionGradients g = attention_backward(dout, q, k, v, attention_forward(q, k, v, o), o);
    return std::vector<std::vector<double>>{g.dquery.to_vector(), g.dkey.to_vector(), g.dvalue.to_vector()};
  };
  on_each_bf16_kernel([&] {
    std::vector<std::vector<double>> fresh;
    std::thread([&] { fresh = gradients(); }).join();
    const int64_t floats = int64_t(1) << 22;  // 16 MiB, more than the call's scratch: it is reused as it is
    float* junk = static_cast<float*>(cpu::thread_scratch_bytes(cpu::ScratchSlot::flash_b, floats * 4));
    std::fill(junk, junk + floats, std::numeric_limits<float>::quiet_NaN());
    EXPECT_EQ(gradients(), fresh);
  });
}

TEST_P(EachIsa, DeterministicAcrossThreadCounts) {
  // 12 entries: one entry per work item on any thread count. 1 entry: one
  // thread runs it whole, two threads split it into key and query tiles.
  // The bits must not change either way.
  for (int64_t heads : {12, 1}) {
    SCOPED_TRACE("entries " + std::to_string(heads));
    const int64_t kv_heads = heads == 12 ? 6 : 1;
    Tensor q = random_tensor({heads, 300, 32}, 1, DType::float32), k = random_tensor({kv_heads, 290, 32}, 2, DType::float32),
           v = random_tensor({kv_heads, 290, 16}, 3, DType::float32), dout = random_tensor({heads, 300, 16}, 4, DType::float32);
    if (heads == 12) q = q.view({2, 6, 300, 32}), dout = dout.view({2, 6, 300, 16}), k = k.view({1, 6, 290, 32}),
                     v = v.view({1, 6, 290, 16});
    AttentionOptions o{.causal = Causal::bottom_right, .dropout_p = 0.2, .dropout_seed = 5, .path = AttentionPath::fused};
    const int saved = omp_get_max_threads();
    std::vector<std::vector<double>> results[2];
    std::vector<double> weights_grads[2];
    const Tensor dw = random_tensor(with_tail(dout.shape(), 290), 6, DType::float32);
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      AttentionOutput f = attention_forward(q, k, v, o);
      AttentionGradients g = attention_backward(dout, q, k, v, f, o);
      results[threads - 1] = {f.out.to_vector(), g.dquery.to_vector(), g.dkey.to_vector(), g.dvalue.to_vector()};
      AttentionOptions w = o;
      w.return_weights = true;
      const AttentionGradients gw = attention_backward(dout, q, k, v, attention_forward(q, k, v, w), w, false, dw);
      weights_grads[threads - 1] = gw.dquery.to_vector();
      const std::vector<double> dk = gw.dkey.to_vector();
      weights_grads[threads - 1].insert(weights_grads[threads - 1].end(), dk.begin(), dk.end());
    }
    omp_set_num_threads(saved);
    EXPECT_EQ(results[0], results[1]);
    EXPECT_EQ(weights_grads[0], weights_grads[1]) << "with a loss on the returned weights";
    // And the split result is right: compare with the reference path.
    AttentionOptions r = o;
    r.path = AttentionPath::reference;
    AttentionOutput f = attention_forward(q, k, v, r);
    AttentionGradients g = attention_backward(dout, q, k, v, f, r);
    EXPECT_LE(max_abs_diff(Tensor::from_values(results[1][1], g.dquery.shape()), g.dquery), 1e-4);
    EXPECT_LE(max_abs_diff(Tensor::from_values(results[1][2], g.dkey.shape()), g.dkey), 1e-4);
    EXPECT_LE(max_abs_diff(Tensor::from_values(results[1][3], g.dvalue.shape()), g.dvalue), 1e-4);
  }
}

// Bit for bit, as contiguous float32 (NaN included).
bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = a.contiguous(), y = b.contiguous();
  return x.shape() == y.shape() && x.dtype() == y.dtype() &&
         std::memcmp(x.raw_data(), y.raw_data(), size_t(x.numel()) * dtype_size(x.dtype())) == 0;
}

// Scores kept by the forward (keep_scores_bytes) give the backward the same
// sums as computing Q·Kᵀ again: the same bits, on one thread (whole entries)
// and two (one entry split into key and query tiles), with every feature;
// kept only by the float32 kernels without a left window and within the budget.
TEST_P(EachIsa, KeptScoresGiveTheSameGradients) {
  std::vector<FlashCase> cases = feature_cases();
  for (const FlashCase& c : shape_cases())
    if (c.q.size() == 4 && c.q[2] % 2 == 1) cases.push_back(c);  // L = 1, 17, 63, 65, 1025 against every S
  cases.push_back({"one entry, causal", {1, 130, 32}, {1, 130, 32}, {1, 130, 32}, {.causal = Causal::top_left}});
  const int saved = omp_get_max_threads();
  for (const FlashCase& c : cases)
    for (int threads : {1, 2}) {
      SCOPED_TRACE(c.name + ", " + std::to_string(threads) + " threads on " + cpu::to_string(cpu::active_isa()));
      omp_set_num_threads(threads);
      Tensor q = random_tensor(c.q, 1, DType::float32), k = random_tensor(c.k, 2, DType::float32),
             v = random_tensor(c.v, 3, DType::float32);
      AttentionOptions plain = c.options, keep = c.options;
      plain.path = keep.path = AttentionPath::fused;
      keep.keep_scores_bytes = int64_t(1) << 40;
      const AttentionOutput a = attention_forward(q, k, v, plain), b = attention_forward(q, k, v, keep);
      EXPECT_FALSE(a.scores.defined());
      const bool left_window = c.options.window_left >= 0;
      const bool by_rows = 4 * c.q[c.q.size() - 2] <= (cpu::active_isa() == cpu::Isa::avx512 ? 16 : 8) && c.options.dropout_p == 0;
      EXPECT_EQ(b.scores.defined(), !left_window && !by_rows);
      EXPECT_TRUE(same_bits(a.out, b.out));
      EXPECT_TRUE(same_bits(a.lse, b.lse));
      const Tensor dout = random_tensor(a.out.shape(), 4, DType::float32);
      const AttentionGradients ga = attention_backward(dout, q, k, v, a, plain), gb = attention_backward(dout, q, k, v, b, keep);
      EXPECT_TRUE(same_bits(ga.dquery, gb.dquery));
      EXPECT_TRUE(same_bits(ga.dkey, gb.dkey));
      EXPECT_TRUE(same_bits(ga.dvalue, gb.dvalue));
      // Scores of another shape are not read: the backward computes them again.
      if (b.scores.defined()) {
        AttentionOutput other = b;
        other.scores = Tensor::zeros({b.scores.numel()});
        EXPECT_TRUE(same_bits(attention_backward(dout, q, k, v, other, keep).dkey, ga.dkey));
      }
      // Over budget: none kept.
      keep.keep_scores_bytes = 1;
      EXPECT_FALSE(attention_forward(q, k, v, keep).scores.defined());
    }
  omp_set_num_threads(saved);
}

INSTANTIATE_TEST_SUITE_P(Flash, EachIsa, ::testing::ValuesIn(cpu::supported_isas()), isa_name);

TEST(KeptScores, NotForBfloat16ProductsNorNegativeBudgets) {
  Tensor q = random_tensor({2, 40, 16}, 1, DType::bfloat16);
  const AttentionOptions keep{.causal = Causal::top_left, .keep_scores_bytes = int64_t(1) << 30};
  const AttentionOutput f = attention_forward(q, q, q, keep);
  EXPECT_EQ(f.scores.defined(), cpu::bf16_products() == cpu::Bf16Products::widen || cpu::active_isa() != cpu::Isa::avx512);
  const AttentionGradients g = attention_backward(random_tensor(f.out.shape(), 2, DType::bfloat16), q, q, q, f, keep);
  EXPECT_TRUE(all_finite(g.dquery));
  EXPECT_THROW(attention_forward(q, q, q, {.keep_scores_bytes = -1}), ValueError);
  EXPECT_THROW(nn::set_score_memory_limit(-1), ValueError);
}

// Past the memory limit the forward keeps none and runs as without them.
TEST(KeptScores, NotPastTheMemoryLimit) {
  const Tensor q = random_tensor({8, 300, 32}, 1, DType::float32);
  AttentionOptions keep{.causal = Causal::top_left, .path = AttentionPath::fused, .keep_scores_bytes = int64_t(1) << 30};
  const AttentionOutput with = attention_forward(q, q, q, keep);  // also takes the per-thread scratch
  ASSERT_TRUE(with.scores.defined());
  ASSERT_GT(with.scores.numel() * 4, int64_t(1) << 20);
  const int64_t limit = memory_limit();
  set_memory_limit(active_memory() + (int64_t(1) << 20));  // room for out and lse, not the scores
  AttentionOutput without;
  EXPECT_NO_THROW(without = attention_forward(q, q, q, keep));
  set_memory_limit(0);  // the default again
  EXPECT_EQ(memory_limit(), limit);
  EXPECT_FALSE(without.scores.defined());
  EXPECT_TRUE(same_bits(with.out, without.out));
}

// A layer in training keeps them (nn::score_memory_limit()), and its gradients
// are those of a layer that keeps none.
TEST(KeptScores, TrainingLayerGradientsUnchanged) {
  Generator gen(5);
  nn::MultiheadAttention m({.embed_dim = 32, .num_heads = 4, .batch_first = true}, gen);
  m.train(true);
  const Tensor x = random_tensor({3, 70, 32}, 1, DType::float32), r = random_tensor({3, 70, 32}, 2, DType::float32);
  const int64_t limit = nn::score_memory_limit();
  std::vector<std::vector<double>> grads[2];
  for (int64_t bytes : {int64_t(0), limit}) {
    nn::set_score_memory_limit(bytes);
    m.zero_grad();
    m.forward(x, x, x, {.need_weights = false, .is_causal = true});
    const nn::MultiheadAttentionInputGradients g = m.backward(r, {}, true);
    auto& out = grads[bytes == 0 ? 0 : 1];
    out.push_back(g.dquery.to_vector());
    for (nn::NamedParameter& p : m.named_parameters()) out.push_back(p.grad->to_vector());
  }
  nn::set_score_memory_limit(limit);
  EXPECT_GT(limit, 0);
  EXPECT_EQ(grads[0], grads[1]);
}

TEST(FlashDispatch, PathRuleAndForcing) {
  Tensor q = random_tensor({1, 5, 4}, 1, DType::float32);
  EXPECT_EQ(attention_forward(q, q, q).path, AttentionPath::fused);
  EXPECT_EQ(attention_forward(q, q, q, {.path = AttentionPath::reference}).path, AttentionPath::reference);
  Tensor d = q.to(DType::float64);
  EXPECT_EQ(attention_forward(d, d, d).path, AttentionPath::reference);
  EXPECT_THROW(attention_forward(d, d, d, {.path = AttentionPath::fused}), ValueError);
  AttentionOptions o{.mask = Tensor::zeros({5, 5}), .path = AttentionPath::fused};
  AttentionOutput f = attention_forward(q, q, q, o);
  EXPECT_THROW(attention_backward(q, q, q, q, f, o, true), ValueError);
  o.path = AttentionPath::automatic;
  EXPECT_NO_THROW(attention_backward(q, q, q, q, f, o, true));  // falls back to the reference path
}
