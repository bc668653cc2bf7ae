// The layer kernels (cpu/layers) and mha's float32 product (cpu/sgemm)
// against their reference path, on every instruction set this CPU supports
// (each forced in turn), at odd sizes (tails of every vector width), with
// huge, tiny and non-finite values; results independent of the thread count.
#include <omp.h>

#include <cstring>
#include <limits>
#include <random>

#include "cpu/flash/dispatch.h"
#include "cpu/fma_rate.h"
#include "cpu/gemm.h"
#include "cpu/layers/layers.h"
#include "cpu/reference/layers.h"
#include "cpu/sgemm/sgemm.h"
#include "cpu/transpose.h"
#include "finite.h"
#include "testing.h"

using namespace mha;

namespace {

class LayerKernels : public ::testing::TestWithParam<cpu::Isa> {
 protected:
  void SetUp() override { cpu::force_isa(GetParam()); }
  void TearDown() override { cpu::force_isa(std::nullopt); }
};

std::string isa_name(const ::testing::TestParamInfo<cpu::Isa>& info) { return cpu::to_string(info.param); }

std::vector<float> random_floats(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

// |a - b| <= atol + rtol·|b| element by element.
void expect_close(const std::vector<float>& a, const std::vector<float>& b, double atol, double rtol,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_LE(std::abs(double(a[i]) - double(b[i])), atol + rtol * std::abs(double(b[i])))
        << what << " at " << i << ": " << a[i] << " vs " << b[i];
}

// Σ_p op(A)[i][p]·op(B)[p][j] in double, A and B stored row-major with leading dimensions lda, ldb.
double product_entry(const std::vector<float>& a, int64_t lda, bool ta, const std::vector<float>& b, int64_t ldb,
                     bool tb, int64_t i, int64_t j, int64_t k) {
  double s = 0;
  for (int64_t p = 0; p < k; ++p)
    s += double(ta ? a[size_t(p * lda + i)] : a[size_t(i * lda + p)]) *
         double(tb ? b[size_t(j * ldb + p)] : b[size_t(p * ldb + j)]);
  return s;
}

constexpr cpu::ActivationKind kKinds[] = {cpu::ActivationKind::relu, cpu::ActivationKind::gelu,
                                          cpu::ActivationKind::gelu_tanh};

TEST_P(LayerKernels, ActivationsMatchReference) {
  for (cpu::ActivationKind kind : kKinds)
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {3, 17}, {5, 33}, {64, 1027}}) {
      SCOPED_TRACE(std::to_string(int(kind)) + " " + std::to_string(rows) + "x" + std::to_string(cols));
      const size_t n = size_t(rows * cols);
      std::vector<float> x = random_floats(n, 1, 3.0f), bias = random_floats(size_t(cols), 2), dy = random_floats(n, 3);
      x[0] = 12.0f;  // far tails of both signs
      if (n > 1) x[1] = -12.0f;
      std::vector<float> pre(n), y(n), pre_ref(n), y_ref(n);
      cpu::activation_forward(kind, x.data(), bias.data(), pre.data(), y.data(), rows, cols);
      cpu::reference::activation_forward<float>(kind, x.data(), bias.data(), pre_ref.data(), y_ref.data(), rows, cols);
      expect_close(pre, pre_ref, 0, 0, "pre-activation");
      expect_close(y, y_ref, 1e-6, 1e-6, "forward");  // A&S 7.1.26: |ΔΦ| ≤ 1.5e-7, times |x|
      std::vector<float> dx(n), dx_ref(n), db(size_t(cols), 0.5f), db_ref(size_t(cols), 0.5f);
      cpu::activation_backward(kind, pre.data(), dy.data(), dx.data(), db.data(), rows, cols);
      cpu::reference::activation_backward<float>(kind, pre.data(), dy.data(), dx_ref.data(), db_ref.data(), rows, cols);
      expect_close(dx, dx_ref, 1e-6, 5e-6, "backward");
      expect_close(db, db_ref, 1e-5, 1e-5, "bias gradient");
    }
}

TEST_P(LayerKernels, ActivationsPropagateNaN) {
  for (cpu::ActivationKind kind : kKinds) {
    std::vector<float> x{1.0f, std::numeric_limits<float>::quiet_NaN(), -2.0f}, y(3);
    cpu::activation_forward(kind, x.data(), nullptr, nullptr, y.data(), 1, 3);
    EXPECT_TRUE(std::isnan(y[1])) << int(kind);
    EXPECT_FALSE(std::isnan(y[0]) || std::isnan(y[2])) << int(kind);
  }
}

// The bfloat16 outputs are the float32 ones rounded as bfloat16's constructor
// rounds (nearest, ties to even; NaN quiet), bit for bit, and the bias
// gradient is the float32 path's. ReLU passes x through, so ties of both
// parities, the largest finite float (rounds to inf), inf and NaN reach the
// rounding as they are.
TEST_P(LayerKernels, ActivationsRoundToBfloat16) {
  const auto float_of = [](uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  };
  for (cpu::ActivationKind kind : kKinds)
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {3, 17}, {5, 33}, {7, 70}}) {
      SCOPED_TRACE(std::to_string(int(kind)) + " " + std::to_string(rows) + "x" + std::to_string(cols));
      const size_t n = size_t(rows * cols);
      std::vector<float> x = random_floats(n, 11, 3.0f), dy = random_floats(n, 12);
      const float specials[] = {float_of(0x3f808000u), float_of(0x3f818000u), float_of(0xbf808000u),
                                float_of(0x3f80ffffu), std::numeric_limits<float>::max(),
                                std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                                float_of(0x7f800001u), 1e-40f};
      for (size_t i = 0; i < n && i < std::size(specials); ++i) x[n - 1 - i] = specials[i];
      std::vector<float> y(n), dx(n), db(size_t(cols), 0.5f), db16(size_t(cols), 0.5f);
      std::vector<bfloat16> y16(n), dx16(n);
      cpu::activation_forward(kind, x.data(), nullptr, nullptr, y.data(), rows, cols);
      cpu::activation_forward(kind, x.data(), nullptr, nullptr, y16.data(), rows, cols);
      cpu::activation_backward(kind, x.data(), dy.data(), dx.data(), db.data(), rows, cols);
      cpu::activation_backward(kind, x.data(), dy.data(), dx16.data(), db16.data(), rows, cols);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(y16[i].bits, bfloat16(y[i]).bits) << "forward at " << i << ": " << y[i];
        ASSERT_EQ(dx16[i].bits, bfloat16(dx[i]).bits) << "backward at " << i << ": " << dx[i];
      }
      for (size_t c = 0; c < size_t(cols); ++c) ASSERT_EQ(std::memcmp(&db[c], &db16[c], 4), 0) << "bias gradient " << c;
    }
}
// Column sums of bfloat16 rows: those of their float32 widening, bit for
// bit (same blocks, same order), at odd widths and with a NaN in a column.
TEST_P(LayerKernels, ColumnSumsOfBfloat16AreThoseOfTheirWidening) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 1}, {9, 17}, {70, 33}, {301, 129}}) {
    SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols));
    const size_t n = size_t(rows * cols);
    std::vector<float> x = random_floats(n, 21, 5.0f);
    if (n > 3) x[3] = std::numeric_limits<float>::quiet_NaN();
    std::vector<bfloat16> x16(n);
    for (size_t i = 0; i < n; ++i) x16[i] = bfloat16(x[i]), x[i] = float(x16[i]);
    std::vector<float> sum(size_t(cols), 0.25f), sum16 = sum;
    cpu::add_column_sums(x.data(), rows, cols, sum.data());
    cpu::add_column_sums(x16.data(), rows, cols, sum16.data());
    for (size_t c = 0; c < size_t(cols); ++c) ASSERT_EQ(std::memcmp(&sum[c], &sum16[c], 4), 0) << c << ": " << sum[c];
    if (n > 3) {
      EXPECT_TRUE(std::isnan(sum16[size_t(3 % cols)]));
    }
  }
}

TEST_P(LayerKernels, LayerNormMatchesReference) {
  for (auto [rows_, D_] : {std::pair<int64_t, int64_t>{1, 1}, {3, 7}, {9, 33}, {70, 259}}) {
    const int64_t rows = rows_, D = D_;  // lambdas below capture them (clang 14 cannot capture bindings)
    for (bool affine : {true, false})
      for (bool with_residual : {false, true}) {
        SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(D) + (affine ? " affine" : "") +
                     (with_residual ? " residual" : ""));
        const size_t n = size_t(rows * D);
        std::vector<float> x = random_floats(n, 4, 2.0f), res = random_floats(n, 5), w = random_floats(size_t(D), 6),
                           b = random_floats(size_t(D), 7), dy = random_floats(n, 8), rg = random_floats(n, 9);
        for (size_t i = 0; i < n; i += 3) x[i] += 100.0f;  // a large mean: the variance must not cancel
        auto forward = [&](auto run, std::vector<float>& sum, std::vector<float>& y, std::vector<float>& mean,
                           std::vector<float>& rstd) {
          cpu::LayerNormForward p{.x = x.data(), .residual = with_residual ? res.data() : nullptr,
                                  .sum = with_residual ? sum.data() : nullptr, .weight = affine ? w.data() : nullptr,
                                  .bias = affine ? b.data() : nullptr, .y = y.data(), .mean = mean.data(),
                                  .rstd = rstd.data(), .rows = rows, .D = D, .eps = 1e-5};
          run(p);
        };
        std::vector<float> sum(n), y(n), mean(static_cast<size_t>(rows)), rstd(static_cast<size_t>(rows));
        std::vector<float> sum_r(n), y_r(n), mean_r(static_cast<size_t>(rows)), rstd_r(static_cast<size_t>(rows));
        forward([](const cpu::LayerNormForward& p) { cpu::layer_norm_forward(p); }, sum, y, mean, rstd);
        forward([](const cpu::LayerNormForward& p) { cpu::reference::layer_norm_forward(p); }, sum_r, y_r, mean_r, rstd_r);
        if (with_residual) expect_close(sum, sum_r, 0, 0, "sum");
        expect_close(mean, mean_r, 1e-6, 1e-6, "mean");
        expect_close(rstd, rstd_r, 1e-6, 1e-4, "rstd");
        expect_close(y, y_r, 1e-4, 1e-4, "forward");
        const float* h = with_residual ? sum_r.data() : x.data();
        std::vector<float> dx(n), dx_r(n), dw(size_t(D), 0.25f), dw_r = dw, db(size_t(D), -0.5f), db_r = db;
        auto backward = [&](auto run, std::vector<float>& out, std::vector<float>& gw, std::vector<float>& gb) {
          cpu::LayerNormBackward p{.h = h, .dy = dy.data(), .weight = affine ? w.data() : nullptr,
                                   .mean = mean_r.data(), .rstd = rstd_r.data(),
                                   .residual_grad = with_residual ? rg.data() : nullptr, .dx = out.data(),
                                   .dweight = affine ? gw.data() : nullptr, .dbias = affine ? gb.data() : nullptr,
                                   .rows = rows, .D = D};
          run(p);
        };
        backward([](const cpu::LayerNormBackward& p) { cpu::layer_norm_backward(p); }, dx, dw, db);
        backward([](const cpu::LayerNormBackward& p) { cpu::reference::layer_norm_backward(p); }, dx_r, dw_r, db_r);
        expect_close(dx, dx_r, 2e-4, 2e-4, "dx");
        expect_close(dw, dw_r, 1e-4, 1e-4, "dweight");
        expect_close(db, db_r, 1e-4, 1e-4, "dbias");
      }
  }
}

TEST_P(LayerKernels, CrossEntropyMatchesReference) {
  for (auto [rows, C] : {std::pair<int64_t, int64_t>{1, 1}, {5, 21}, {67, 130}})
    for (double smoothing : {0.0, 0.1}) {
      SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(C) + " smoothing " + std::to_string(smoothing));
      const size_t n = size_t(rows * C);
      std::vector<float> logits = random_floats(n, 10, 4.0f);
      logits[0] = 1e4f;  // huge logits stay finite
      std::vector<int64_t> targets(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) targets[size_t(r)] = r % 4 == 3 ? -100 : (r * 7) % C;
      std::vector<float> d(n, 9.0f), d_r(n, 9.0f);
      const cpu::CrossEntropy p{.logits = logits.data(), .targets = targets.data(), .dlogits = d.data(), .rows = rows,
                                .C = C, .ignore_index = -100, .label_smoothing = smoothing, .grad_scale = 0.5};
      cpu::CrossEntropy q = p;
      q.dlogits = d_r.data();
      int64_t count, correct, count_r, correct_r;
      const double loss = cpu::cross_entropy_forward_backward(p, &count, &correct);
      const double loss_r = cpu::reference::cross_entropy_forward_backward(q, &count_r, &correct_r);
      EXPECT_NEAR(loss, loss_r, 1e-5 * std::max(1.0, std::abs(loss_r)));
      EXPECT_EQ(count, count_r);
      EXPECT_EQ(correct, correct_r);
      expect_close(d, d_r, 1e-7, 1e-5, "dlogits");
    }
}

TEST_P(LayerKernels, CrossEntropyLossIsNaNForANaNLogit) {
  std::vector<float> logits{1, 2, std::numeric_limits<float>::quiet_NaN(), 0}, d(4);
  const int64_t target = 0;
  int64_t count, correct;
  const double loss = cpu::cross_entropy_forward_backward(
      {.logits = logits.data(), .targets = &target, .dlogits = d.data(), .rows = 1, .C = 4}, &count, &correct);
  EXPECT_TRUE(std::isnan(loss));
}

TEST_P(LayerKernels, AdamWAndNormsMatchReference) {
  for (int64_t n : {1, 15, 17, 100003}) {
    std::vector<float> p = random_floats(size_t(n), 11), g = random_floats(size_t(n), 12), m = random_floats(size_t(n), 13),
                       v = random_floats(size_t(n), 14);
    for (float& x : v) x = x * x;
    std::vector<float> p_r = p, m_r = m, v_r = v;
    cpu::AdamWStep s{.param = p.data(), .exp_avg = m.data(), .exp_avg_sq = v.data(), .grad = g.data(), .n = n,
                     .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .bias1 = 0.19,
                     .bias2 = 0.002};
    cpu::adamw_step(s);
    s.param = p_r.data(), s.exp_avg = m_r.data(), s.exp_avg_sq = v_r.data();
    cpu::reference::adamw_step(s);
    expect_close(p, p_r, 1e-6, 1e-6, "param");
    expect_close(m, m_r, 1e-7, 1e-6, "exp_avg");
    expect_close(v, v_r, 1e-7, 1e-6, "exp_avg_sq");
    double sq = 0;
    for (float x : g) sq += double(x) * double(x);
    EXPECT_NEAR(cpu::sum_of_squares(g.data(), n), sq, 1e-5 * sq);
    std::vector<float> scaled = g;
    cpu::scale_in_place(scaled.data(), n, 0.5f);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(scaled[size_t(i)], 0.5f * g[size_t(i)]);
    std::vector<float> sum(static_cast<size_t>(n));
    cpu::add_arrays(p.data(), g.data(), sum.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(sum[size_t(i)], p[size_t(i)] + g[size_t(i)]);
  }
}

// The finite scan against a plain loop: one NaN or infinity anywhere (first,
// middle, last lane, the tail past the last whole vector) is found; the largest
// float, subnormals and zeros of both signs are finite.
TEST_P(LayerKernels, FiniteScanFindsEveryNaNAndInfinity) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float finite_extremes[] = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                                   std::numeric_limits<float>::denorm_min(), -0.0f};
  for (int64_t n : {1, 7, 15, 16, 17, 63, 64, 65, 100003}) {
    std::vector<float> x = random_floats(size_t(n), 21, 1e3f);
    EXPECT_TRUE(cpu::finite_floats(x.data(), n)) << n;
    EXPECT_TRUE(cpu::finite_floats(x.data(), 0));
    for (int64_t at : {int64_t(0), n / 2, n - 1}) {
      for (float bad : {nan, inf, -inf}) {
        std::vector<float> y = x;
        y[size_t(at)] = bad;
        EXPECT_FALSE(cpu::finite_floats(y.data(), n)) << n << " " << at << " " << bad;
        EXPECT_FALSE(all_finite(y.data(), n)) << n << " " << at << " " << bad;
        EXPECT_EQ(all_finite(y.data(), n, /*minus_inf_ok=*/true), bad == -inf) << n << " " << at << " " << bad;
        if (at > 0) {
          EXPECT_TRUE(cpu::finite_floats(y.data(), at)) << "only the first " << at << " of " << n;
        }
      }
      for (float ok : finite_extremes) {
        std::vector<float> y = x;
        y[size_t(at)] = ok;
        EXPECT_TRUE(cpu::finite_floats(y.data(), n)) << n << " " << at << " " << ok;
      }
    }
  }
}

TEST_P(LayerKernels, ResultsDoNotDependOnThreads) {
  const int64_t rows = 301, D = 129;
  const size_t n = size_t(rows * D);
  std::vector<float> x = random_floats(n, 15), dy = random_floats(n, 16), w = random_floats(size_t(D), 17);
  std::vector<float> y(n), mean(static_cast<size_t>(rows)), rstd(static_cast<size_t>(rows));
  cpu::layer_norm_forward({.x = x.data(), .weight = w.data(), .bias = w.data(), .y = y.data(), .mean = mean.data(),
                           .rstd = rstd.data(), .rows = rows, .D = D});
  auto run = [&](int threads) {
    omp_set_num_threads(threads);
    std::vector<float> dx(n), dw(size_t(D), 0.0f), db(size_t(D), 0.0f), colsum(size_t(D), 0.0f), dact(n);
    cpu::layer_norm_backward({.h = x.data(), .dy = dy.data(), .weight = w.data(), .mean = mean.data(),
                              .rstd = rstd.data(), .dx = dx.data(), .dweight = dw.data(), .dbias = db.data(),
                              .rows = rows, .D = D});
    cpu::add_column_sums(dy.data(), rows, D, colsum.data());
    cpu::activation_backward(cpu::ActivationKind::gelu, x.data(), dy.data(), dact.data(), colsum.data(), rows, D);
    dx.insert(dx.end(), dw.begin(), dw.end());
    dx.insert(dx.end(), db.begin(), db.end());
    dx.insert(dx.end(), colsum.begin(), colsum.end());
    return dx;
  };
  const int before = omp_get_max_threads();
  const std::vector<float> one = run(1), two = run(2), three = run(3);
  omp_set_num_threads(before);
  EXPECT_EQ(one, two);
  EXPECT_EQ(one, three);
}

// mha's float32 product (cpu::gemm<float> on the scalar path) against a float64 triple loop: every transpose,
// alpha/beta, odd sizes, K past one depth block.
TEST_P(LayerKernels, SgemmMatchesReference) {
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {5, 17, 3}, {16, 70, 129}, {17, 9, 40}, {33, 129, 65},
                         {70, 31, 777}, {2, 300, 0},
                         {400, 45, 520},   // K blocks of 256, 256, 8 over row tiles of 108 (wider than 96)
                         {21, 35, 1300},  // a transposed A's K blocks: 1024 + 276 (AMD's AVX-512) or 512 + 512 + 276
                         // whole panels, narrow strides: a transposed A read in place (reads_in_place), with a
                         // last group of 1 (37 rows) or 10 and 4 rows (130: 12- and 6-row groups), and none
                         {37, 64, 1300}, {130, 96, 300}, {24, 32, 7},
                         // the skinny tiles (tb, m <= 16) of every count of rows left (cpu/skinny.h): 2, 3, 4 + 3
                         {2, 37, 300}, {3, 29, 17}, {7, 50, 33}})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (auto [alpha, beta] : {std::pair{1.0f, 0.0f}, {1.0f, 1.0f}, {0.5f, -2.0f}})
          for (bool with_bias : {false, true}) {
            SCOPED_TRACE(std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) + (ta ? " ta" : "") +
                         (tb ? " tb" : "") + " alpha " + std::to_string(alpha) + " beta " + std::to_string(beta) +
                         (with_bias ? " + bias" : ""));
            const std::vector<float> bias_values = random_floats(size_t(n), 21);
            const float* bias = with_bias ? bias_values.data() : nullptr;
            const int64_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 2, ldc = n + 5;
            std::vector<float> a = random_floats(size_t((ta ? k : m) * lda), 18), b = random_floats(size_t((tb ? n : k) * ldb), 19);
            std::vector<float> c = random_floats(size_t(m * ldc), 20), c_ref = c;
            if (beta == 0.0f)  // C is not read: NaN there must not come through
              for (float& x : c) x = std::numeric_limits<float>::quiet_NaN();
            // The scalar path has no kernel of mha's own: there, the dispatch (OpenBLAS).
            if (GetParam() == cpu::Isa::avx512) cpu::sgemm_avx512(ta, tb, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc, bias);
            else if (GetParam() == cpu::Isa::avx2) cpu::sgemm_avx2(ta, tb, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc, bias);
            else if (!bias) cpu::gemm<float>(ta, tb, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
            else continue;  // (gemm_bias, the layers' entry, is Gemm.SplitOverThreadsMatchesReference's)
            for (int64_t i = 0; i < m; ++i)
              for (int64_t j = 0; j < n; ++j) {
                const double want = alpha * product_entry(a, lda, ta, b, ldb, tb, i, j, k) +
                                    (beta == 0.0f ? 0.0 : beta * double(c_ref[size_t(i * ldc + j)])) +
                                    (bias ? double(bias[size_t(j)]) : 0.0);
                ASSERT_NEAR(c[size_t(i * ldc + j)], want, 1e-4 * (1 + std::sqrt(double(k)))) << i << "," << j;
              }
            for (int64_t i = 0; i < m; ++i)  // the padding between rows of C is untouched
              for (int64_t j = n; j < ldc; ++j)
                ASSERT_TRUE(beta == 0.0f ? std::isnan(c[size_t(i * ldc + j)]) : c[size_t(i * ldc + j)] == c_ref[size_t(i * ldc + j)]);
          }
}

// f() on the calling thread, or (nested) on one thread of a parallel region
// of two, as a product called from inside a layer's region runs.
template <class F>
void on_one_thread_of_a_team_or_not(bool nested, F&& f) {
  if (!nested) return f();
#pragma omp parallel num_threads(2)
#pragma omp single
  f();
}

// A weight gradient with more columns than rows (at least 128 rows) and k
// past one depth block (256) on mha's kernels: cpu::gemm<float> computes it
// as its transpose and adds that to C (gemm.cpp, as_transpose). beta 0 (C
// not read) and 1, alpha 1 and (not that way) 0.5, from a parallel region
// too; C's padding untouched; beside it shapes that do not go that way.
TEST_P(LayerKernels, WeightGradientAsItsTransposeMatchesReference) {
  cpu::force_sgemm_backend(cpu::GemmBackend::mha);
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{129, 131, 300}, {133, 290, 257}, {37, 129, 300}, {5, 5, 600}})
    for (auto [alpha, beta] : {std::pair{1.0f, 0.0f}, {1.0f, 1.0f}, {0.5f, 1.0f}})
      for (bool nested : {false, true}) {
        SCOPED_TRACE(std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) + " alpha " +
                     std::to_string(alpha) + " beta " + std::to_string(beta) + (nested ? " in a parallel region" : ""));
        const int64_t lda = m + 3, ldb = n + 2, ldc = n + 5;
        const std::vector<float> a = random_floats(size_t(k * lda), 24), b = random_floats(size_t(k * ldb), 25);
        std::vector<float> c = random_floats(size_t(m * ldc), 26), c_ref = c;
        if (beta == 0.0f)
          for (float& x : c) x = std::numeric_limits<float>::quiet_NaN();
        // (structured bindings captured by copy: clang 14 refuses them in a [&])
        const auto product = [&, m = m, n = n, k = k, alpha = alpha, beta = beta] {
          cpu::gemm<float>(true, false, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
        };
        on_one_thread_of_a_team_or_not(nested, product);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            const double want = alpha * product_entry(a, lda, true, b, ldb, false, i, j, k) +
                                (beta == 0.0f ? 0.0 : beta * double(c_ref[size_t(i * ldc + j)]));
            ASSERT_NEAR(c[size_t(i * ldc + j)], want, 1e-4 * (1 + std::sqrt(double(k)))) << i << "," << j;
          }
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = n; j < ldc; ++j)
            ASSERT_TRUE(beta == 0.0f ? std::isnan(c[size_t(i * ldc + j)]) : c[size_t(i * ldc + j)] == c_ref[size_t(i * ldc + j)]);
      }
  cpu::force_sgemm_backend(std::nullopt);
}

// cpu::gemm<float> as the layers call it: on OpenBLAS its rows or columns
// split over OpenMP's threads (gemm.cpp), on mha's kernel whole. Extents
// that 16 does not divide, both splits, both transposes, from a parallel
// region too; the OpenMP thread count the caller had is left as it was
// (OpenBLAS sets it when told its own). Products of at most 16 rows against
// a transposed B (decoding's, mha's kernel under every backend) and 17.
TEST(Gemm, SplitOverThreadsMatchesReference) {
  const int before = omp_get_max_threads();
  for (const cpu::GemmBackend backend : {cpu::GemmBackend::openblas, cpu::GemmBackend::mha, cpu::GemmBackend::mixed})
  for (const auto& shape : {std::tuple<int64_t, int64_t, int64_t>{1001, 67, 129}, {67, 1001, 129}, {129, 130, 131},
                             {2, 40000, 5}, {16, 301, 70}, {17, 301, 70}})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (bool nested : {false, true})
          for (bool with_bias : {false, true}) {
            const int64_t m = std::get<0>(shape), n = std::get<1>(shape), k = std::get<2>(shape);  // (the lambda captures them)
            SCOPED_TRACE(cpu::to_string(backend) + " " + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) + (ta ? " ta" : "") +
                         (tb ? " tb" : "") + (nested ? " in a parallel region" : "") + (with_bias ? " + bias" : ""));
            const int64_t lda = (ta ? m : k) + 1, ldb = (tb ? k : n) + 3, ldc = n + 2;
            const std::vector<float> a = random_floats(size_t((ta ? k : m) * lda), 21),
                                     b = random_floats(size_t((tb ? n : k) * ldb), 22), bias = random_floats(size_t(n), 23);
            std::vector<float> c(size_t(m * ldc), std::numeric_limits<float>::quiet_NaN());
            const auto product = [&] {  // gemm_bias: C = op(A) op(B) + bias on every row; C not read
              if (with_bias) cpu::gemm_bias(ta, tb, m, n, k, a.data(), lda, b.data(), ldb, bias.data(), c.data(), ldc);
              else cpu::gemm<float>(ta, tb, m, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), ldc);
            };
            cpu::force_sgemm_backend(backend);
            on_one_thread_of_a_team_or_not(nested, product);
            cpu::force_sgemm_backend(std::nullopt);
            EXPECT_EQ(omp_get_max_threads(), before);
            for (int64_t i = 0; i < m; ++i)
              for (int64_t j = 0; j < n; ++j) {
                const double want = product_entry(a, lda, ta, b, ldb, tb, i, j, k) + (with_bias ? bias[size_t(j)] : 0.0);
                ASSERT_NEAR(c[size_t(i * ldc + j)], want, 1e-4 * (1 + std::sqrt(double(k)))) << i << "," << j;
              }
            for (int64_t i = 0; i < m; ++i)  // the padding between rows of C is untouched
              for (int64_t j = n; j < ldc; ++j) ASSERT_TRUE(std::isnan(c[size_t(i * ldc + j)]));
          }
}

// transpose_block (the packing of a transposed B, C plus a product's
// transpose, the attention's query tiles) against the copy element by
// element: whole 4 × 4 blocks, partial ones at every edge (rows and columns
// 1 to 9), strides past the extents, writing and adding; what lies between
// the destination's rows untouched.
TEST(Transpose, BlocksMatchTheCopyElementByElement) {
  for (int64_t rows = 1; rows <= 9; ++rows)
    for (int64_t cols = 1; cols <= 9; ++cols)
      for (bool add : {false, true}) {
        SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols) + (add ? " added" : ""));
        const int64_t src_row = cols + 3, dst_row = rows + 2;
        const std::vector<float> src = random_floats(size_t(rows * src_row), 31);
        std::vector<float> dst = random_floats(size_t(cols * dst_row), 32), want = dst;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            float& out = want[size_t(c * dst_row + r)];
            out = add ? out + src[size_t(r * src_row + c)] : src[size_t(r * src_row + c)];
          }
        if (add) cpu::transpose_block<true>(src.data(), src_row, rows, cols, dst.data(), dst_row);
        else cpu::transpose_block<false>(src.data(), src_row, rows, cols, dst.data(), dst_row);
        for (size_t i = 0; i < dst.size(); ++i) ASSERT_EQ(dst[i], want[i]) << "element " << i;
      }
}

// Which CPUs keep OpenBLAS: its AVX-512 sets for the weight gradients beside
// mha's AVX-512 kernel (mixed), or for everything under AVX2 kernels; its
// AVX2 sets unless the active kernels are AVX-512 on full-width pipes (Zen 5
// under 0.3.21, which calls it Haswell); an older fallback (Prescott) never;
// without AVX2 there is nothing else.
TEST(Gemm, BackendByOpenBlasKernelsAndCpu) {
  using B = cpu::GemmBackend;
  for (const char* core : {"SkylakeX", "Cooperlake", "SapphireRapids"}) {
    EXPECT_EQ(cpu::sgemm_backend_for(core, true, true, true), B::mixed) << core;
    EXPECT_EQ(cpu::sgemm_backend_for(core, true, true, false), B::mixed) << core;
    EXPECT_EQ(cpu::sgemm_backend_for(core, true, false, false), B::openblas) << core;  // AVX2 kernels forced
  }
  for (const char* core : {"Haswell", "Zen"}) {
    EXPECT_EQ(cpu::sgemm_backend_for(core, true, false, false), B::openblas) << core;
    EXPECT_EQ(cpu::sgemm_backend_for(core, true, true, false), B::openblas) << core;  // Zen 4
    EXPECT_EQ(cpu::sgemm_backend_for(core, true, true, true), B::mha) << core;        // Zen 5
  }
  EXPECT_EQ(cpu::sgemm_backend_for("Prescott", true, false, false), B::mha);
  EXPECT_EQ(cpu::sgemm_backend_for("Prescott", true, true, true), B::mha);
  EXPECT_EQ(cpu::sgemm_backend_for("Prescott", false, false, false), B::openblas);
}

// The FMA-rate probe behind that choice: each supported kind runs at a
// positive rate, an unsupported one is reported as such, and without
// AVX-512 the 512-bit rate cannot double anything.
TEST(Gemm, FmaRateProbe) {
  for (const cpu::FmaKind kind : {cpu::FmaKind::f32_256, cpu::FmaKind::f32_512, cpu::FmaKind::bf16_512}) {
    if (!cpu::fma_supported(kind)) continue;
    EXPECT_GT(cpu::fma_gflops_one_thread(kind, 10000, 2), 0.0);
    EXPECT_GT(cpu::fma_iteration_flops(kind), 0.0);
  }
  EXPECT_EQ(cpu::fma_supported(cpu::FmaKind::f32_512), bool(__builtin_cpu_supports("avx512f")));
  if (!cpu::fma_supported(cpu::FmaKind::f32_512)) {
    EXPECT_FALSE(cpu::avx512_doubles_fma_rate());
  }
  EXPECT_EQ(cpu::avx512_doubles_fma_rate(), cpu::avx512_doubles_fma_rate());  // measured once
}

INSTANTIATE_TEST_SUITE_P(Layers, LayerKernels, ::testing::ValuesIn(cpu::supported_isas()), isa_name);

}  // namespace
