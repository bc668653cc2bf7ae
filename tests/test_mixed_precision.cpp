// bf16-mixed precision: the bfloat16 products against float64 sums of the
// rounded operands, then every mixed layer against its float32 path on the
// same weights and inputs (odd sizes, forward and backward, every
// instruction set of the attention core), decoding, the weight copies, errors.
//
// Why no finite differences here: under bf16_mixed the forward is piecewise
// constant in x and W (their bfloat16 roundings change in steps), so its true
// derivative is 0 almost everywhere. What backward computes is the derivative
// with the rounding taken as the identity ("straight through"), with dy
// rounded too. Linear is checked against exactly that formula in float64;
// for the larger layers the gradients must agree with the float32 ones
// within bfloat16 tolerance (relative error ≤ 1e-2 in the 2-norm).
#include <cstdio>
#include <cstring>
#include <limits>

#include "cpu/flash/dispatch.h"
#include "cpu/gemm.h"
#include "cpu/layers/layers.h"
#include "testing.h"

using namespace mha;
using namespace mha::nn;
using namespace mha::testing;

namespace {

double rounded(double x) { return double(float(bfloat16(float(x)))); }

// A float64 copy of t with every element rounded to bfloat16.
Tensor rounded(const Tensor& t) {
  std::vector<double> v = t.to_vector();
  for (double& x : v) x = rounded(x);
  return Tensor::from_values(v, t.shape(), DType::float64);
}

// ||a − b|| / ||b|| over all elements (b: the reference).
double relative_error(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  double diff = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) diff += (x[i] - y[i]) * (x[i] - y[i]), norm += y[i] * y[i];
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

// Copies every parameter of `from` into `to` (same architecture).
void copy_parameters(Module& from, Module& to) {
  auto a = from.named_parameters(), b = to.named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) b[i].value->copy_(*a[i].value);
}

// Every parameter's gradient of `mixed` against `reference`'s; returns the worst relative error.
double worst_gradient_error(Module& mixed, Module& reference, double tolerance) {
  auto a = mixed.named_parameters(), b = reference.named_parameters();
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = relative_error(*a[i].grad, *b[i].grad);
    EXPECT_LE(e, tolerance) << a[i].name;
    worst = std::max(worst, e);
  }
  return worst;
}

}  // namespace

TEST(Bf16Gemm, RoundsToNearestEvenOnEveryIsa) {
  const float tie_down = 1.0f + 0x1p-8f, tie_up = 1.0f + 3 * 0x1p-8f, above = 1.0f + 0x1p-8f + 0x1p-20f;
  const std::vector<float> special{0.0f, -0.0f, 1.0f, tie_down, tie_up, above, 3.14159f, -2.5e-3f, 1e-40f,
                                   std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(),
                                   -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  // The special values, then random ones, then the special values again in
  // the vector lanes: 13 + 40 + 13 values (full vectors and a tail).
  std::vector<float> x = special;
  for (double v : random_tensor({40}, 1).to_vector()) x.push_back(float(v * 1e3));
  x.insert(x.end(), special.begin(), special.end());
  for (cpu::Isa isa : cpu::supported_isas()) {
    cpu::force_isa(isa);
    std::vector<bfloat16> y(x.size());
    cpu::round_to_bf16(x.data(), y.data(), int64_t(x.size()));
    for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(y[i].bits, bfloat16(x[i]).bits) << x[i] << " " << cpu::to_string(isa);
    for (size_t at : {size_t(0), x.size() - special.size()}) {
      EXPECT_EQ(float(y[at + 3]), 1.0f);                // a tie goes to the even neighbour: down
      EXPECT_EQ(float(y[at + 4]), 1.0f + 4 * 0x1p-8f);  // and up
      EXPECT_EQ(float(y[at + 5]), 1.0f + 2 * 0x1p-8f);  // past the tie: up
      EXPECT_NE(float(y[at + 8]), 0.0f);                // a denormal stays
      EXPECT_TRUE(std::isinf(float(y[at + 9])));        // FLT_MAX overflows
      EXPECT_TRUE(std::isnan(float(y[at + 12])));
    }
  }
  cpu::force_isa(std::nullopt);
}

namespace {

// C = alpha op(A) op(B) + beta C by `product` against float64 sums of the
// bfloat16 operands, with padded leading dimensions (odd and even).
template <class Product>
void check_bf16_products(const std::string& path, const Product& product,
                         std::initializer_list<std::tuple<int64_t, int64_t, int64_t>> sizes) {
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (auto [m, n, k] : sizes)
        for (int64_t pad : {2, 3})
          for (auto [alpha, beta] : {std::pair{0.5f, 0.75f}, {1.0f, 0.0f}, {1.0f, 1.0f}}) {
            SCOPED_TRACE(path + " ta " + std::to_string(ta) + " tb " + std::to_string(tb) + " " + std::to_string(m) +
                         "x" + std::to_string(n) + "x" + std::to_string(k) + " pad " + std::to_string(pad) +
                         " alpha " + std::to_string(alpha) + " beta " + std::to_string(beta));
            const int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
            const int64_t lda = a_cols + pad, ldb = b_cols + pad, ldc = n + 1;
            const Tensor a = random_tensor({std::max<int64_t>(a_rows, 1), lda}, 1, DType::bfloat16);
            const Tensor b = random_tensor({std::max<int64_t>(b_rows, 1), ldb}, 2, DType::bfloat16);
            Tensor c = random_tensor({m, ldc}, 3, DType::float32);
            const std::vector<double> av = a.to_vector(), bv = b.to_vector(), c0 = c.to_vector();
            product(ta, tb, m, n, k, alpha, a.data<bfloat16>(), lda, b.data<bfloat16>(), ldb, beta, c.data<float>(), ldc);
            const std::vector<double> cv = c.to_vector();
            double worst = 0;
            for (int64_t i = 0; i < m; ++i) {
              for (int64_t j = 0; j < n; ++j) {
                double want = double(beta) * c0[size_t(i * ldc + j)], size = std::abs(want);
                for (int64_t p = 0; p < k; ++p) {
                  const double term = double(alpha) * av[size_t(ta ? p * lda + i : i * lda + p)] *
                                      bv[size_t(tb ? j * ldb + p : p * ldb + j)];
                  want += term, size += std::abs(term);
                }
                worst = std::max(worst, std::abs(cv[size_t(i * ldc + j)] - want) / std::max(size, 1e-30));
              }
              ASSERT_EQ(cv[size_t(i * ldc + n)], c0[size_t(i * ldc + n)]);  // past n: untouched
            }
            EXPECT_LE(worst, 1e-6);
          }
}

}  // namespace

TEST(Bf16Gemm, MatchesFloat64SumsOfTheOperandsAtOddSizesOnEveryIsa) {
  // cpu::gemm's choice on each instruction set (the AVX512-BF16 kernel or
  // the widening path), then the AVX512-BF16 kernel itself where the CPU has
  // it, also past one block of pairs (128), past one tile of rows (192) and
  // one block of columns (512), past one span of pairs (2048, k > 4096),
  // with fewer groups of 6 rows than threads (its tiles split columns), and
  // with at most 16 rows (its dot-product path for a transposed B) past one
  // vector of k; cpu::gemm also with more columns than rows (128 or more)
  // and k past 256, which it computes as the transpose where op(A) is Aᵀ.
  for (cpu::Isa isa : cpu::supported_isas()) {
    cpu::force_isa(isa);
    check_bf16_products("gemm on " + cpu::to_string(isa),
                        [](auto... args) { cpu::gemm(args...); },
                        {{1, 1, 1}, {7, 13, 6}, {33, 17, 65}, {70, 150, 34}, {4, 3, 0},
                         {129, 150, 300}});  // with a transposed A: as its transpose (gemm.cpp)
  }
  cpu::force_isa(std::nullopt);
  if (__builtin_cpu_supports("avx512bf16"))
    check_bf16_products("gemm_bf16_avx512", [](auto... args) { cpu::gemm_bf16_avx512(args...); },
                        {{1, 1, 1}, {7, 13, 6}, {33, 17, 65}, {4, 3, 0}, {130, 530, 401}, {401, 37, 65}, {13, 70, 4201},
                         {5, 300, 101}, {9, 21, 75}, {16, 5, 64}, {2, 37, 70}, {3, 29, 45}, {6, 50, 33}});
  // AMX: one tile (16), a block (32), past a work item (128 × 256) and a
  // chunk of 256 pairs (k > 512), odd everywhere.
  if (cpu::amx_bf16_usable())
    check_bf16_products("gemm_bf16_amx", [](auto... args) { cpu::gemm_bf16_amx(args...); },
                        {{1, 1, 1}, {7, 13, 6}, {16, 16, 32}, {33, 17, 65}, {4, 3, 0}, {130, 530, 401},
                         {47, 35, 1031}, {300, 70, 33}});
}

TEST(Bf16Gemm, EveryKindOfProductRunsWhereSupportedAndIsRefusedElsewhere) {
  const std::vector<cpu::Bf16Products> kinds = cpu::supported_bf16_products();
  EXPECT_EQ(kinds.front(), cpu::Bf16Products::widen);
  for (cpu::Bf16Products kind : {cpu::Bf16Products::widen, cpu::Bf16Products::dot, cpu::Bf16Products::amx}) {
    if (std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) {
      EXPECT_THROW(cpu::force_bf16_products(kind), DeviceError) << cpu::to_string(kind);
      continue;
    }
    cpu::force_bf16_products(kind);
    EXPECT_EQ(cpu::bf16_products(), kind);
    check_bf16_products("gemm, " + cpu::to_string(kind) + " products", [](auto... args) { cpu::gemm(args...); },
                        {{5, 9, 33}, {20, 40, 70}});
  }
  cpu::force_bf16_products(std::nullopt);
}

// gemm_bias on bfloat16 operands: C = op(A)·op(B) + bias, the same bits as C
// filled with the bias and the product added (beta 1), on every kind of
// product; the dot kernel adds the bias as it stores its first block of k
// (full micro-tiles and edges, past one block of pairs, one tile of rows and
// one panel), the rest fill C first. C's NaN is never read.
TEST(Bf16Gemm, BiasAddedAsStoredIsTheFilledProductBitForBit) {
  for (cpu::Bf16Products kind : cpu::supported_bf16_products()) {
    cpu::force_bf16_products(kind);
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {7, 13, 6}, {12, 64, 40},
                               {13, 70, 301}, {200, 130, 33}, {5, 9, 2}}) {
          SCOPED_TRACE(cpu::to_string(kind) + " ta " + std::to_string(ta) + " tb " + std::to_string(tb) + " " +
                       std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k));
          const int64_t lda = (ta ? m : k) + 1, ldb = (tb ? k : n) + 3, ldc = n + 2;
          const Tensor a = random_tensor({ta ? k : m, lda}, 4, DType::bfloat16);
          const Tensor b = random_tensor({tb ? n : k, ldb}, 5, DType::bfloat16);
          const Tensor bias = random_tensor({n}, 6, DType::float32);
          Tensor c = Tensor::full({m, ldc}, NAN), want = Tensor::zeros({m, ldc});
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) want.data<float>()[i * ldc + j] = bias.data<float>()[j];
          cpu::gemm(ta, tb, m, n, k, 1.0f, a.data<bfloat16>(), lda, b.data<bfloat16>(), ldb, 1.0f,
                    want.data<float>(), ldc);
          cpu::gemm_bias(ta, tb, m, n, k, a.data<bfloat16>(), lda, b.data<bfloat16>(), ldb, bias.data<float>(),
                         c.data<float>(), ldc);
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) {
              const float got = c.data<float>()[i * ldc + j], expected = want.data<float>()[i * ldc + j];
              ASSERT_EQ(std::memcmp(&got, &expected, 4), 0) << i << "," << j << ": " << got << " vs " << expected;
            }
        }
  }
  cpu::force_bf16_products(std::nullopt);
}

TEST(Bf16Gemm, BetaZeroIgnoresWhatCHeld) {
  // As in BLAS, C is not read when beta = 0 (NaN there stays out of the result).
  for (cpu::Isa isa : cpu::supported_isas()) {
    cpu::force_isa(isa);
    const Tensor a = random_tensor({5, 8}, 1, DType::bfloat16), b = random_tensor({8, 3}, 2, DType::bfloat16);
    Tensor c = Tensor::full({5, 3}, NAN);
    cpu::gemm(false, false, 5, 3, 8, 1.0f, a.data<bfloat16>(), 8, b.data<bfloat16>(), 3, 0.0f, c.data<float>(), 3);
    EXPECT_TRUE(all_finite(c)) << cpu::to_string(isa);
  }
  cpu::force_isa(std::nullopt);
}

TEST(MixedPrecision, LinearIsTheFormulaOnRoundedOperands) {
  Generator g(1);
  Linear reference({.in_features = 13, .out_features = 7}, g);
  Linear mixed({.in_features = 13, .out_features = 7, .precision = Precision::bf16_mixed}, g);
  copy_parameters(reference, mixed);
  const Tensor x = random_tensor({3, 5, 13}, 2, DType::float32), dy = random_tensor({3, 5, 7}, 3, DType::float32);
  const Tensor y = mixed.forward(x);
  mixed.zero_grad();
  const Tensor dx = mixed.backward(dy);
  // The formula in float64: y = r(x) r(W)ᵀ + b, dx = r(dy) r(W), dW = r(dy)ᵀ r(x), db = Σ dy.
  const Tensor xr = rounded(x), wr = rounded(mixed.weight), dyr = rounded(dy);
  double ey = 0, edx = 0, edw = 0, edb = 0;
  for (int64_t r = 0; r < 15; ++r)
    for (int64_t o = 0; o < 7; ++o) {
      double want = mixed.bias.item({o});
      for (int64_t i = 0; i < 13; ++i) want += xr.item({r / 5, r % 5, i}) * wr.item({o, i});
      ey = std::max(ey, std::abs(y.item({r / 5, r % 5, o}) - want));
    }
  for (int64_t r = 0; r < 15; ++r)
    for (int64_t i = 0; i < 13; ++i) {
      double want = 0;
      for (int64_t o = 0; o < 7; ++o) want += dyr.item({r / 5, r % 5, o}) * wr.item({o, i});
      edx = std::max(edx, std::abs(dx.item({r / 5, r % 5, i}) - want));
    }
  for (int64_t o = 0; o < 7; ++o) {
    double want_b = 0;
    for (int64_t r = 0; r < 15; ++r) want_b += dy.item({r / 5, r % 5, o});
    edb = std::max(edb, std::abs(mixed.bias_grad.item({o}) - want_b));
    for (int64_t i = 0; i < 13; ++i) {
      double want = 0;
      for (int64_t r = 0; r < 15; ++r) want += dyr.item({r / 5, r % 5, o}) * xr.item({r / 5, r % 5, i});
      edw = std::max(edw, std::abs(mixed.weight_grad.item({o, i}) - want));
    }
  }
  EXPECT_LT(ey, 1e-5);
  EXPECT_LT(edx, 1e-5);
  EXPECT_LT(edw, 1e-5);
  EXPECT_LT(edb, 1e-5);
  // And within bfloat16 tolerance of the float32 layer.
  const Tensor y32 = reference.forward(x);
  reference.zero_grad();
  const Tensor dx32 = reference.backward(dy);
  EXPECT_LE(relative_error(y, y32), 1e-2);
  EXPECT_LE(relative_error(dx, dx32), 1e-2);
  EXPECT_GT(relative_error(y, y32), 0.0);  // the products really were rounded
  worst_gradient_error(mixed, reference, 1e-2);
}

TEST(MixedPrecision, WeightCopiesFollowTheWeights) {
  Generator g(2);
  Linear lin({.in_features = 4, .out_features = 3, .bias = false, .precision = Precision::bf16_mixed}, g);
  const Tensor x = Tensor::full({1, 4}, 1.0);
  // Training: every forward rounds the weights afresh.
  const double before = lin.forward(x).item({0, 0});
  lin.weight.fill_(0.25);
  EXPECT_EQ(lin.forward(x).item({0, 0}), 1.0);
  // Eval: the copy is kept from call to call, and eval()/train() drop it.
  lin.eval();
  EXPECT_EQ(lin.forward(x).item({0, 0}), 1.0);
  lin.weight.fill_(0.5);
  EXPECT_EQ(lin.forward(x).item({0, 0}), 1.0);  // documented: frozen in eval mode
  lin.eval();
  EXPECT_EQ(lin.forward(x).item({0, 0}), 2.0);
  lin.weight = Tensor::full({3, 4}, 0.75);  // a replaced tensor is noticed
  EXPECT_EQ(lin.forward(x).item({0, 0}), 3.0);
  EXPECT_NE(before, 3.0);
  // A copy of the layer keeps copies of its own: its refresh leaves the original's alone.
  Linear twin = lin;
  twin.weight = Tensor::full({3, 4}, 0.125);
  EXPECT_EQ(twin.forward(x).item({0, 0}), 0.5);
  lin.weight.fill_(1.0);  // in eval mode the original still uses its copy of 0.75
  EXPECT_EQ(lin.forward(x).item({0, 0}), 3.0);
}

namespace {

struct AttentionCase {
  std::string name;
  MultiheadAttentionConfig config;
  Shape query, key, value;
  bool self_attention = false;
  MultiheadAttentionInputs inputs;
};

// Forward (output, weights) and every gradient of a mixed module against the
// float32 module with the same parameters; returns the worst relative error.
double compare_attention(const AttentionCase& c) {
  SCOPED_TRACE(c.name + " on " + cpu::to_string(cpu::active_isa()));
  Generator g(3);
  MultiheadAttentionConfig mixed_config = c.config;
  mixed_config.precision = Precision::bf16_mixed;
  MultiheadAttention reference(c.config, g), mixed(mixed_config, g);
  for (NamedParameter& p : reference.named_parameters())  // non-zero biases
    if (p.name.find("bias") != std::string::npos)
      p.value->copy_(random_tensor(p.value->shape(), 10 + p.name.size(), DType::float32, 0.3));
  copy_parameters(reference, mixed);
  const Tensor query = random_tensor(c.query, 4, DType::float32);
  const Tensor key = c.self_attention ? query : random_tensor(c.key, 5, DType::float32);
  const Tensor value = c.self_attention ? query : random_tensor(c.value, 6, DType::float32);
  double worst = 0;
  auto check = [&](const Tensor& a, const Tensor& b, const std::string& what) {
    EXPECT_EQ(a.dtype(), DType::float32) << what;
    const double e = relative_error(a, b);
    EXPECT_LE(e, 1e-2) << what;
    worst = std::max(worst, e);
  };
  const MultiheadAttentionOutput a = mixed.forward(query, key, value, c.inputs);
  const MultiheadAttentionOutput b = reference.forward(query, key, value, c.inputs);
  check(a.output, b.output, "output");
  if (c.inputs.need_weights) check(a.weights, b.weights, "weights");
  const Tensor dy = random_tensor(b.output.shape(), 7, DType::float32);
  mixed.zero_grad();
  reference.zero_grad();
  const MultiheadAttentionInputGradients ga = mixed.backward(dy), gb = reference.backward(dy);
  if (c.self_attention) {
    check(add(add(ga.dquery, ga.dkey), ga.dvalue), add(add(gb.dquery, gb.dkey), gb.dvalue), "dx");
  } else {
    check(ga.dquery, gb.dquery, "dquery");
    check(ga.dkey, gb.dkey, "dkey");
    check(ga.dvalue, gb.dvalue, "dvalue");
  }
  if (c.inputs.attn_bias_grad) check(ga.dattn_bias, gb.dattn_bias, "dattn_bias");
  worst = std::max(worst, worst_gradient_error(mixed, reference, 1e-2));
  return worst;
}

}  // namespace

TEST(MixedPrecision, MultiheadAttentionAgreesWithFloat32OnEveryIsa) {
  const int64_t L = 7, S = 9, N = 2;
  Tensor kpm = Tensor::from_bools(std::vector<bool>(size_t(N * L), false), {N, L});
  kpm.set_item({1, 5}, 1.0);
  const std::vector<AttentionCase> cases{
      {"self, causal, padding, odd head dim", {.embed_dim = 15, .num_heads = 3}, {L, N, 15}, {}, {}, true,
       {.key_padding_mask = kpm, .is_causal = true}},
      {"cross, kdim/vdim, bias_kv, zero_attn, float mask, batch_first",
       {.embed_dim = 12, .num_heads = 4, .add_bias_kv = true, .add_zero_attn = true, .kdim = 11, .vdim = 13,
        .batch_first = true},
       {N, L, 12}, {N, S, 11}, {N, S, 13}, false,
       {.need_weights = true, .attn_mask = random_tensor({L, S}, 8, DType::float32, 0.5), .average_attn_weights = false}},
      {"self, rope, additive bias with its gradient (reference core)",
       {.embed_dim = 12, .num_heads = 2, .batch_first = true, .rotary_base = 100.0}, {N, L, 12}, {}, {}, true,
       {.need_weights = false, .is_causal = true, .attn_bias = random_tensor({1, 2, L, L}, 9, DType::float32),
        .attn_bias_grad = true}},
  };
  for (cpu::Isa isa : cpu::supported_isas()) {
    cpu::force_isa(isa);
    for (const AttentionCase& c : cases)
      std::printf("  %-64s %-6s worst relative error %.1e\n", c.name.c_str(), cpu::to_string(isa).c_str(),
                  compare_attention(c));
  }
  cpu::force_isa(std::nullopt);
}

namespace {

LanguageModelConfig small_language_model(Position position, Precision precision) {
  return {.vocab_size = 13, .d_model = 16, .nhead = 2, .num_layers = 2, .dim_feedforward = 24,
          .position = position, .precision = precision};
}

Tensor random_ids(int64_t B, int64_t L, uint64_t seed) {
  Generator g(seed);
  Tensor ids = Tensor::empty({B, L}, DType::int64);
  for (int64_t i = 0; i < B * L; ++i) ids.data<int64_t>()[i] = int64_t(g.next_u64() % 13);
  return ids;
}

}  // namespace

TEST(MixedPrecision, LanguageModelAgreesWithFloat32AndDecodesAsItRuns) {
  for (Position position : {Position::sinusoidal, Position::rope, Position::relative}) {
    SCOPED_TRACE(to_string(position));
    Generator g1(4), g2(4);  // the same initialisation
    LanguageModel reference(small_language_model(position, Precision::float32), g1);
    LanguageModel mixed(small_language_model(position, Precision::bf16_mixed), g2);
    const Tensor ids = random_ids(3, 11, 5), targets = random_ids(3, 11, 6);
    const Tensor logits = mixed.forward(ids), logits32 = reference.forward(ids);
    EXPECT_LE(relative_error(logits, logits32), 1e-2);
    const CrossEntropyResult loss = cross_entropy(logits, targets), loss32 = cross_entropy(logits32, targets);
    EXPECT_NEAR(loss.loss, loss32.loss, 1e-2 * loss32.loss);
    mixed.zero_grad();
    reference.zero_grad();
    mixed.backward(loss.dlogits);
    reference.backward(loss32.dlogits);
    std::printf("  language model, %-10s logits %.1e, worst gradient %.1e (relative errors)\n",
                to_string(position).c_str(), relative_error(logits, logits32),
                worst_gradient_error(mixed, reference, 2e-2));
    // Decoding with bfloat16 KV caches: the logits of the whole sequence.
    mixed.eval();
    const Tensor whole = mixed.forward(ids);
    mixed.begin_decode();
    const Tensor first = mixed.decode_step(ids.slice(1, 0, 6));
    const Tensor rest = mixed.decode_step(ids.slice(1, 6, 11));
    EXPECT_LE(relative_error(first, whole.slice(1, 0, 6)), 1e-5);
    EXPECT_LE(relative_error(rest, whole.slice(1, 6, 11)), 1e-5);
  }
}

TEST(MixedPrecision, Errors) {
  Generator g;
  try {
    Linear({.in_features = 2, .out_features = 2, .dtype = DType::float64, .precision = Precision::bf16_mixed}, g);
    ADD_FAILURE() << "expected DtypeError";
  } catch (const DtypeError& e) {
    EXPECT_NE(std::string(e.what()).find("[mha::nn::Linear] dtype: expected float32 under bf16-mixed precision"),
              std::string::npos) << e.what();
  }
  EXPECT_THROW(MultiheadAttention({.embed_dim = 4, .dtype = DType::float64, .precision = Precision::bf16_mixed}, g),
               DtypeError);
  EXPECT_EQ(parse_precision("bf16-mixed"), Precision::bf16_mixed);
  EXPECT_EQ(to_string(Precision::float32), "float32");
  EXPECT_THROW(parse_precision("fp16"), ValueError);
  // A mixed module's KV cache is bfloat16: a float32 one is refused.
  MultiheadAttention attention({.embed_dim = 4, .num_heads = 2, .batch_first = true, .precision = Precision::bf16_mixed}, g);
  KVCache cache{Tensor::zeros({1, 4, 4}), Tensor::zeros({1, 4, 4}), 2};
  EXPECT_THROW(attention.forward_cached(Tensor::zeros({1, 1, 4}), cache), ShapeError);
}

// Operands rounded ahead (the activation writing bfloat16 for the Linear
// after it, under bf16-mixed) change nothing: the same bits as the layers
// rounding them themselves.
TEST(MixedPrecision, OperandsRoundedAheadGiveTheSameBits) {
  const auto same_bits = [](const Tensor& a, const Tensor& b, const char* what) {
    ASSERT_EQ(a.dtype(), b.dtype()) << what;
    ASSERT_EQ(a.shape(), b.shape()) << what;
    EXPECT_EQ(std::memcmp(a.raw_data(), b.raw_data(), size_t(a.numel()) * dtype_size(a.dtype())), 0) << what;
  };
  Generator g(3);
  Linear mixed({.in_features = 37, .out_features = 19, .precision = Precision::bf16_mixed}, g);
  const Tensor x = random_tensor({3, 7, 37}, 4, DType::float32), dy = random_tensor({3, 7, 19}, 5, DType::float32);
  same_bits(mixed.forward(x.to(DType::bfloat16)), mixed.forward(x), "y");
  mixed.zero_grad();
  const Tensor dx = mixed.backward(dy, /*bias_grad_added=*/true);
  const Tensor dw = mixed.weight_grad.clone();
  mixed.zero_grad();
  same_bits(mixed.backward(dy.to(DType::bfloat16), true), dx, "dx");
  same_bits(mixed.weight_grad, dw, "dW");

  for (Activation kind : {Activation::gelu, Activation::relu}) {
    ActivationLayer act(kind);
    const Tensor pre = random_tensor({5, 43}, 6, DType::float32), g_out = random_tensor({5, 43}, 7, DType::float32);
    const Tensor y = act.forward(pre, DType::float32);
    same_bits(act.forward(pre, DType::bfloat16), y.to(DType::bfloat16), "activation");
    Tensor db32 = Tensor::zeros({43}), db16 = Tensor::zeros({43});
    const Tensor d32 = act.backward(g_out, db32, DType::float32);
    same_bits(act.backward(g_out, db16, DType::bfloat16), d32.to(DType::bfloat16), "activation's gradient");
    same_bits(db16, db32, "bias gradient");
  }
}

TEST(MixedPrecision, RoundedOperandsWhereTheyDoNotBelongAreRefused) {
  Generator g(4);
  Linear plain({.in_features = 4, .out_features = 3}, g);
  Linear mixed({.in_features = 4, .out_features = 3, .precision = Precision::bf16_mixed}, g);
  const Tensor x16 = Tensor::zeros({2, 4}).to(DType::bfloat16);
  expect_error<DtypeError>([&] { plain.forward(x16); }, "[mha::nn::Linear::forward] x: expected float32");
  mixed.forward(Tensor::zeros({2, 4}));
  // The bias gradient needs dy unrounded unless it was summed already.
  expect_error<DtypeError>([&] { mixed.backward(Tensor::zeros({2, 3}).to(DType::bfloat16)); },
                           "[mha::nn::Linear::backward] dy: expected float32");
  GELU gelu;
  expect_error<DtypeError>([&] { gelu.forward(Tensor::zeros({2, 4}, DType::float64), DType::bfloat16); },
                           "[mha::nn::GELU::forward] out: expected float64 (the input's); got bfloat16");
  gelu.forward(Tensor::zeros({2, 4}));
  expect_error<DtypeError>([&] { gelu.backward(Tensor::zeros({2, 4}), DType::float64); },
                           "[mha::nn::GELU::backward] out: expected float32 (the input's) or bfloat16; got float64");
}
