// Linformer: attention over the projected keys and values (against the
// definition), exact with k = S and identity projections, error against exact
// attention falling as k grows on low-rank inputs, finite-difference
// gradients of every input and both projections, L = 1, typed errors.
#include "mha/variants/linformer.h"
#include "variants_testing.h"

using namespace mha;
using namespace mha::testing;

namespace {

Tensor identity(int64_t n) {
  Tensor t = Tensor::zeros({n, n}, DType::float64);
  for (int64_t i = 0; i < n; ++i) t.set_item({i, i}, 1.0);
  return t;
}

// Mean pooling of S positions into k equal segments: row r averages positions [r·S/k, (r+1)·S/k).
Tensor mean_pooling(int64_t k, int64_t S) {
  Tensor t = Tensor::zeros({k, S}, DType::float64);
  for (int64_t r = 0; r < k; ++r)
    for (int64_t j = r * S / k; j < (r + 1) * S / k; ++j) t.set_item({r, j}, 1.0 / double(S / k));
  return t;
}

// (batch, S, width) sequences of low rank along the sequence: a few slow
// cosines with random coefficients per feature.
Tensor smooth_sequences(int64_t batch, int64_t S, int64_t width, uint64_t seed) {
  const Tensor coefficients = random_tensor({batch, 3, width}, seed);
  Tensor t = Tensor::zeros({batch, S, width}, DType::float64);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < S; ++j)
      for (int64_t e = 0; e < width; ++e) {
        double x = 0;
        for (int64_t f = 0; f < 3; ++f) x += coefficients.item({b, f, e}) * std::cos(3.14159265358979 * double(f + 1) * double(j) / double(S));
        t.set_item({b, j, e}, 2 * x);
      }
  return t;
}

}  // namespace

TEST(Linformer, AttendsToTheProjectedRows) {
  Tensor q = random_tensor({2, 3, 7, 5}, 1), k = random_tensor({2, 3, 11, 5}, 2), v = random_tensor({2, 3, 11, 4}, 3);
  const LinformerOptions o{.key_projection = linformer_projection(4, 11, 1, DType::float64),
                           .value_projection = linformer_projection(4, 11, 2, DType::float64), .scale = 0.9};
  LinformerOutput f = linformer_attention_forward(q, k, v, o);
  EXPECT_EQ(f.projected_key.shape(), (Shape{2, 3, 4, 5}));
  // K̄ = P_K K row by row, then plain attention.
  Tensor kbar = Tensor::zeros({2, 3, 4, 5}, DType::float64), vbar = Tensor::zeros({2, 3, 4, 4}, DType::float64);
  for (int64_t a = 0; a < 2; ++a)
    for (int64_t h = 0; h < 3; ++h)
      for (int64_t r = 0; r < 4; ++r)
        for (int64_t j = 0; j < 11; ++j) {
          for (int64_t e = 0; e < 5; ++e)
            kbar.set_item({a, h, r, e}, kbar.item({a, h, r, e}) + o.key_projection.item({r, j}) * k.item({a, h, j, e}));
          for (int64_t e = 0; e < 4; ++e)
            vbar.set_item({a, h, r, e}, vbar.item({a, h, r, e}) + o.value_projection.item({r, j}) * v.item({a, h, j, e}));
        }
  EXPECT_LT(max_abs_diff(f.projected_key, kbar), 1e-13);
  EXPECT_LT(max_abs_diff(f.out, naive_attention(q, kbar, vbar, {.scale = 0.9}, {2, 3}).out), 1e-13);
  // float32 runs the fused path inside and agrees.
  const LinformerOptions o32{.key_projection = o.key_projection.to(DType::float32),
                             .value_projection = o.value_projection.to(DType::float32), .scale = 0.9};
  EXPECT_LT(max_abs_diff(linformer_attention_forward(q.to(DType::float32), k.to(DType::float32), v.to(DType::float32), o32).out, f.out),
            2e-5);
}

TEST(Linformer, IdentityProjectionsGiveExactAttention) {
  Tensor q = random_tensor({3, 9, 4}, 1), k = random_tensor({3, 13, 4}, 2), v = random_tensor({3, 13, 2}, 3);
  LinformerOutput f = linformer_attention_forward(q, k, v, {.key_projection = identity(13), .value_projection = identity(13)});
  EXPECT_LT(max_abs_diff(f.out, attention_forward(q, k, v).out), 1e-14);
}

TEST(Linformer, ErrorFallsAsKGrowsOnLowRankInputs) {
  const int64_t S = 256;
  Tensor q = random_tensor({4, 64, 16}, 1), k = smooth_sequences(4, S, 16, 2), v = smooth_sequences(4, S, 8, 3);
  const Tensor exact = attention_forward(q, k, v).out;
  std::vector<double> errors;
  std::printf("  linformer, mean pooling:");
  for (int64_t rank : {4, 8, 16, 32, 64, 128}) {
    const Tensor pool = mean_pooling(rank, S);
    const Tensor out = linformer_attention_forward(q, k, v, {.key_projection = pool, .value_projection = pool}).out;
    errors.push_back(max_abs_diff(out, exact) / max_abs(exact));
    std::printf(" k=%lld %.2e", (long long)rank, errors.back());
  }
  std::printf("\n");
  for (size_t x = 1; x < errors.size(); ++x) EXPECT_LT(errors[x], errors[x - 1]) << "k step " << x;
  EXPECT_LT(errors.back(), errors.front() / 20);
}

TEST(Linformer, FiniteDifferenceGradients) {
  Tensor q = random_tensor({2, 7, 3}, 11), k = random_tensor({2, 9, 3}, 12), v = random_tensor({2, 9, 2}, 13);
  LinformerOptions o{.key_projection = linformer_projection(4, 9, 1, DType::float64),
                     .value_projection = linformer_projection(4, 9, 2, DType::float64), .scale = 1.1};
  LinformerOutput f = linformer_attention_forward(q, k, v, o);
  Tensor r = random_tensor(f.out.shape(), 14);
  LinformerGradients g = linformer_attention_backward(r, q, k, v, f, o);
  expect_gradients("linformer L=7 S=9 k=4", r, [&] { return linformer_attention_forward(q, k, v, o).out; },
                   {{"dq", q, g.dquery}, {"dk", k, g.dkey}, {"dv", v, g.dvalue},
                    {"dP_K", o.key_projection, g.dkey_projection}, {"dP_V", o.value_projection, g.dvalue_projection}});
}

TEST(Linformer, LengthOne) {
  Tensor q = random_tensor({2, 1, 3}, 1), k = random_tensor({2, 1, 3}, 2), v = random_tensor({2, 1, 2}, 3);
  const LinformerOptions o{.key_projection = Tensor::full({1, 1}, 1.0, DType::float64),
                           .value_projection = Tensor::full({1, 1}, 1.0, DType::float64)};
  LinformerOutput f = linformer_attention_forward(q, k, v, o);
  EXPECT_LT(max_abs_diff(f.out, v), 1e-15);
  LinformerGradients g = linformer_attention_backward(v, q, k, v, f, o);
  EXPECT_TRUE(all_finite(g.dquery) && all_finite(g.dkey) && all_finite(g.dvalue) && all_finite(g.dkey_projection));
}

TEST(Linformer, Errors) {
  Tensor q = random_tensor({2, 7, 3}, 1), k = random_tensor({2, 9, 3}, 2), v = random_tensor({2, 9, 2}, 3);
  const Tensor p = linformer_projection(4, 9, 1, DType::float64);
  const std::string fn = "[mha::linformer_attention_forward] ";
  expect_error<ShapeError>([&] { linformer_attention_forward(q, k, v, {.key_projection = p}); },
                 fn + "options.value_projection: expected a defined tensor");
  expect_error<ShapeError>([&] { linformer_attention_forward(q, k, v, {.key_projection = linformer_projection(4, 8, 1, DType::float64), .value_projection = p}); },
                 fn + "options.key_projection: expected dim -1 S = 9 (key's); got (4, 8)");
  expect_error<ShapeError>([&] { linformer_attention_forward(q, k, v, {.key_projection = p, .value_projection = linformer_projection(5, 9, 1, DType::float64)}); },
                 fn + "options.value_projection: expected k = 4 rows (key_projection's); got (5, 9)");
  expect_error<DtypeError>([&] { linformer_attention_forward(q, k, v, {.key_projection = p.to(DType::float32), .value_projection = p}); },
                 fn + "options.key_projection: expected query's dtype float64; got float32");
  expect_error<ValueError>([&] { linformer_attention_forward(q, k, v, {.key_projection = p, .value_projection = p, .path = AttentionPath::fused}); },
                 fn + "options.path: expected float32 inputs for the fused path; got float64 inputs");
  expect_error<ValueError>([&] { linformer_projection(0, 9, 1); }, "[mha::linformer_projection] k: expected >= 1; got 0");
  const LinformerOptions o{.key_projection = p, .value_projection = p};
  LinformerOutput f = linformer_attention_forward(q, k, v, o);
  expect_error<ShapeError>([&] { linformer_attention_backward(k, q, k, v, f, o); },
                 "[mha::linformer_attention_backward] dout: expected shape (2, 7, 2); got (2, 9, 3)");
}
