// Reformer LSH attention: one bucket is full attention without the diagonal
// (any number of rounds); several buckets and rounds equal an independent
// dense computation from the buckets lsh_buckets reports; the error against
// exact attention falls as rounds are added; finite-difference gradients in
// double, also over many chunks (the backward's sweeps hand look-back
// gradients across their borders); results that do not depend on the thread
// count; L = 1 and zero queries without NaN; typed errors.
#include <omp.h>

#include <algorithm>
#include <map>

#include "mha/variants/lsh.h"
#include "variants_testing.h"

using namespace mha;
using namespace mha::testing;

namespace {

// Rows of q normalised: the shared-QK keys.
Tensor normalised(const Tensor& q) {
  Tensor k = q.contiguous().clone();
  const int64_t rows = k.numel() / k.size(-1), E = k.size(-1);
  std::vector<double> x = k.to_vector();
  for (int64_t r = 0; r < rows; ++r) {
    double n = 0;
    for (int64_t e = 0; e < E; ++e) n += x[size_t(r * E + e)] * x[size_t(r * E + e)];
    for (int64_t e = 0; e < E; ++e) x[size_t(r * E + e)] /= std::sqrt(n);
  }
  return Tensor::from_values(x, k.shape(), q.dtype());
}

// Full attention's mask under the self rule: j != i (and j < i when causal),
// except that a row with no other key (row 0 when causal) attends to itself.
Tensor self_rule_mask(int64_t L, bool causal) {
  Tensor m = Tensor::zeros({L, L}, DType::boolean);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < L; ++j) m.set_item({i, j}, j != i && (!causal || j < i));
  if (causal || L == 1) m.set_item({0, 0}, 1.0);
  return m;
}

// LSH attention straight from the definition, given the buckets: every
// round's sorted chunks and look-back windows as a multiset of keys per query.
Tensor dense_lsh(const Tensor& q, const Tensor& v, const Tensor& buckets, const LshOptions& o) {
  const int64_t L = q.size(-2), E = q.size(-1), Ev = v.size(-1), B = q.numel() / (L * E);
  const double scale = o.scale ? *o.scale : 1.0 / std::sqrt(double(E));
  const std::vector<double> qv = q.to_vector(), kv = normalised(q).to_vector(), vv = v.to_vector(), hv = buckets.to_vector();
  std::vector<double> out(size_t(B * L * Ev), 0.0);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<std::map<int64_t, int>> count(static_cast<size_t>(L));
    for (int64_t r = 0; r < o.hashes; ++r) {
      std::vector<int64_t> order(static_cast<size_t>(L));
      for (int64_t i = 0; i < L; ++i) order[size_t(i)] = i;
      std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
        return hv[size_t((r * B + b) * L + x)] < hv[size_t((r * B + b) * L + y)];
      });
      const int64_t chunks = (L + o.chunk - 1) / o.chunk;
      for (int64_t p = 0; p < L; ++p) {
        const int64_t c = p / o.chunk;
        std::vector<int64_t> seen_chunks{c};
        if (chunks > 1) seen_chunks.push_back((c + chunks - 1) % chunks);
        for (int64_t sc : seen_chunks)
          for (int64_t x = sc * o.chunk; x < std::min(L, (sc + 1) * o.chunk); ++x) {
            const int64_t i = order[size_t(p)], j = order[size_t(x)];
            if (j != i && (!o.causal || j < i)) ++count[size_t(i)][j];
          }
      }
    }
    for (int64_t i = 0; i < L; ++i) {
      double* o_i = &out[size_t((b * L + i) * Ev)];
      if (count[size_t(i)].empty()) {
        for (int64_t e = 0; e < Ev; ++e) o_i[e] = vv[size_t((b * L + i) * Ev + e)];
        continue;
      }
      double den = 0;
      for (auto [j, n] : count[size_t(i)]) {
        double s = 0;
        for (int64_t e = 0; e < E; ++e) s += qv[size_t((b * L + i) * E + e)] * kv[size_t((b * L + j) * E + e)];
        const double w = n * std::exp(scale * s);
        den += w;
        for (int64_t e = 0; e < Ev; ++e) o_i[e] += w * vv[size_t((b * L + j) * Ev + e)];
      }
      for (int64_t e = 0; e < Ev; ++e) o_i[e] /= den;
    }
  }
  return Tensor::from_values(out, v.shape(), DType::float64);
}

}  // namespace

TEST(Lsh, OneBucketIsFullAttentionWithoutTheDiagonal) {
  for (bool causal : {false, true})
    for (int64_t hashes : {1, 3}) {  // several rounds of one bucket count every key alike: the same result
      for (DType dtype : {DType::float64, DType::float32}) {
        SCOPED_TRACE(std::string(causal ? "causal " : "") + std::to_string(hashes) + " rounds " + to_string(dtype));
        Tensor q = random_tensor({2, 3, 37, 5}, 1, dtype), v = random_tensor({2, 3, 37, 3}, 2, dtype);
        const LshOptions o{.buckets = 1, .hashes = hashes, .chunk = 64, .causal = causal, .scale = 0.8};
        LshOutput f = lsh_attention_forward(q, v, o);
        const Tensor k = normalised(q);
        const AttentionOptions full{.mask = self_rule_mask(37, causal), .scale = 0.8, .path = AttentionPath::reference};
        AttentionOutput a = attention_forward(q, k, v, full);
        const double tol = dtype == DType::float64 ? 1e-12 : 2e-5;
        EXPECT_LT(max_abs_diff(f.out, a.out), tol);
        // Each round finds every key: lse counts them `hashes` times (but the causal first row only sees itself).
        std::vector<double> la = f.lse.to_vector(), lb = a.lse.to_vector();
        for (size_t i = 0; i < la.size(); ++i)
          EXPECT_NEAR(la[i], lb[i] + (causal && i % 37 == 0 ? 0.0 : std::log(double(hashes))), 10 * tol) << i;
        // Gradients: full attention's, with dk carried to q through the normalisation.
        Tensor dout = random_tensor(f.out.shape(), 3, dtype);
        LshGradients g = lsh_attention_backward(dout, q, v, f, o);
        AttentionGradients ga = attention_backward(dout, q, k, v, a, full);
        std::vector<double> dq = ga.dquery.to_vector(), dk = ga.dkey.to_vector(), kv = k.to_vector(), qv = q.to_vector();
        for (size_t r = 0; r < dq.size() / 5; ++r) {
          double dot = 0, norm = 0;
          for (size_t e = 0; e < 5; ++e) dot += kv[r * 5 + e] * dk[r * 5 + e], norm += qv[r * 5 + e] * qv[r * 5 + e];
          for (size_t e = 0; e < 5; ++e) dq[r * 5 + e] += (dk[r * 5 + e] - kv[r * 5 + e] * dot) / std::sqrt(norm);
        }
        EXPECT_LT(max_abs_diff(g.dquery, Tensor::from_values(dq, q.shape(), DType::float64)), 20 * tol);
        EXPECT_LT(max_abs_diff(g.dvalue, ga.dvalue), 10 * tol);
      }
    }
}

TEST(Lsh, EqualsDenseDefinitionFromTheBuckets) {
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    Tensor q = random_tensor({2, 41, 6}, 1), v = random_tensor({2, 41, 3}, 2);
    const LshOptions o{.buckets = 6, .hashes = 3, .chunk = 5, .seed = 17, .causal = causal};
    const Tensor buckets = lsh_buckets(q, o);
    EXPECT_EQ(buckets.shape(), (Shape{3, 2, 41}));
    EXPECT_LT(max_abs_diff(lsh_attention_forward(q, v, o).out, dense_lsh(q, v, buckets, o)), 1e-12);
    EXPECT_LT(max_abs_diff(lsh_attention_forward(q.to(DType::float32), v.to(DType::float32), o).out, dense_lsh(q, v, buckets, o)),
              2e-5);
  }
}

TEST(Lsh, BucketsComeFromTheSeed) {
  Tensor q = random_tensor({3, 50, 8}, 1);
  const Tensor a = lsh_buckets(q, {.buckets = 8, .hashes = 2, .seed = 5});
  EXPECT_EQ(max_abs_diff(a, lsh_buckets(q, {.buckets = 8, .hashes = 2, .seed = 5})), 0.0);
  EXPECT_GT(max_abs_diff(a, lsh_buckets(q, {.buckets = 8, .hashes = 2, .seed = 6})), 0.0);
  std::vector<double> h = a.to_vector();
  EXPECT_EQ(*std::min_element(h.begin(), h.end()), 0.0);
  EXPECT_EQ(*std::max_element(h.begin(), h.end()), 7.0);
  // Angular: a query and its positive multiple share every bucket.
  Tensor scaled = Tensor::from_values(q.to_vector(), q.shape(), DType::float64);
  for (int64_t e = 0; e < 8; ++e) scaled.set_item({0, 0, e}, 3.0 * q.item({0, 0, e}));
  EXPECT_EQ(lsh_buckets(scaled, {.buckets = 8, .hashes = 2, .seed = 5}).item({1, 0, 0}), a.item({1, 0, 0}));
}

TEST(Lsh, ErrorFallsAsRoundsGrow) {
  // 16 clusters of directions and a sharp softmax (scale 10), so that a few
  // nearby keys carry each query's attention and hashing can find them.
  const int64_t L = 256, E = 16;
  Tensor centres = random_tensor({16, E}, 1, DType::float64, 3.0), noise = random_tensor({L, E}, 2);
  Tensor q = Tensor::zeros({L, E}, DType::float64);
  for (int64_t i = 0; i < L; ++i)
    for (int64_t e = 0; e < E; ++e) q.set_item({i, e}, centres.item({(i * 5) % 16, e}) + noise.item({i, e}));
  Tensor v = random_tensor({L, 8}, 3);
  const Tensor exact = attention_forward(q, normalised(q), v, {.mask = self_rule_mask(L, false), .scale = 10.0}).out;
  std::vector<double> errors;
  std::printf("  lsh, 32 buckets, chunk 32, relative error:");
  for (int64_t hashes : {1, 2, 4, 8}) {
    double sum = 0;
    for (uint64_t seed = 0; seed < 3; ++seed)
      sum += relative_error(
          lsh_attention_forward(q, v, {.buckets = 32, .hashes = hashes, .chunk = 32, .seed = seed, .scale = 10.0}).out, exact);
    errors.push_back(sum / 3);
    std::printf(" %lld rounds %.3f", (long long)hashes, errors.back());
  }
  std::printf("\n");
  for (size_t x = 1; x < errors.size(); ++x) EXPECT_LT(errors[x], errors[x - 1]) << "step " << x;
  EXPECT_LT(errors.back(), errors.front() / 4);
}

// The backward of the causal and non-causal forms against central differences.
void expect_lsh_gradients(const std::string& name, const Shape& qshape, const Shape& vshape, LshOptions o, uint64_t seed) {
  for (bool causal : {false, true}) {
    o.causal = causal;
    Tensor q = random_tensor(qshape, seed), v = random_tensor(vshape, seed + 1);
    LshOutput f = lsh_attention_forward(q, v, o);
    Tensor r = random_tensor(f.out.shape(), seed + 2);
    LshGradients g = lsh_attention_backward(r, q, v, f, o);
    expect_gradients((causal ? "lsh causal " : "lsh ") + name, r, [&] { return lsh_attention_forward(q, v, o).out; },
                     {{"dq", q, g.dquery}, {"dv", v, g.dvalue}});
  }
}

TEST(Lsh, FiniteDifferenceGradients) {
  expect_lsh_gradients("L=23 4 buckets 2 rounds", {2, 23, 4}, {2, 23, 3},
                       {.buckets = 4, .hashes = 2, .chunk = 4, .seed = 3, .scale = 0.9}, 11);
}

TEST(Lsh, FiniteDifferenceGradientsOverManyChunks) {
  // One bucket (no hash to flip under ±h): the chunks are runs of positions,
  // 40 of them, more than one sweep of the backward.
  expect_lsh_gradients("L=120 40 chunks", {1, 120, 3}, {1, 120, 2}, {.buckets = 1, .hashes = 2, .chunk = 3, .scale = 0.7}, 21);
}

TEST(Lsh, ResultsDoNotDependOnThreadCount) {
  Tensor q = random_tensor({2, 700, 8}, 31, DType::float32), v = random_tensor({2, 700, 5}, 32, DType::float32),
         dout = random_tensor({2, 700, 5}, 33, DType::float32);
  const LshOptions o{.buckets = 16, .hashes = 3, .chunk = 4, .seed = 9};
  const int saved = omp_get_max_threads();
  std::vector<std::vector<double>> results[2];
  for (int threads : {1, 3}) {
    omp_set_num_threads(threads);
    LshOutput f = lsh_attention_forward(q, v, o);
    LshGradients g = lsh_attention_backward(dout, q, v, f, o);
    results[threads == 3] = {f.out.to_vector(), f.lse.to_vector(), g.dquery.to_vector(), g.dvalue.to_vector()};
  }
  omp_set_num_threads(saved);
  for (size_t x = 0; x < results[0].size(); ++x) EXPECT_EQ(results[0][x], results[1][x]) << x;
}

TEST(Lsh, LengthOneAndZeroQueriesGiveNoNaN) {
  for (bool causal : {false, true}) {
    Tensor q = random_tensor({2, 1, 4}, 1), v = random_tensor({2, 1, 3}, 2);
    LshOutput f = lsh_attention_forward(q, v, {.causal = causal});
    EXPECT_LT(max_abs_diff(f.out, v), 1e-15);  // nothing but itself
    LshGradients g = lsh_attention_backward(v, q, v, f, {.causal = causal});
    EXPECT_LT(max_abs_diff(g.dvalue, v), 1e-15);
    EXPECT_EQ(max_abs(g.dquery), 0.0);
    Tensor zeros = Tensor::zeros({2, 9, 4}, DType::float64), w = random_tensor({2, 9, 3}, 3);
    LshOutput z = lsh_attention_forward(zeros, w, {.buckets = 2, .chunk = 3, .causal = causal});
    LshGradients gz = lsh_attention_backward(w, zeros, w, z, {.buckets = 2, .chunk = 3, .causal = causal});
    EXPECT_TRUE(all_finite(z.out) && all_finite(z.lse) && all_finite(gz.dquery) && all_finite(gz.dvalue));
  }
}

TEST(Lsh, Errors) {
  Tensor q = random_tensor({2, 10, 4}, 1), v = random_tensor({2, 10, 3}, 2);
  const std::string fn = "[mha::lsh_attention_forward] ";
  expect_error<ValueError>([&] { lsh_attention_forward(q, v, {.buckets = 3}); }, fn + "options.buckets: expected 1 or an even number >= 2; got 3");
  expect_error<ValueError>([&] { lsh_attention_forward(q, v, {.hashes = 0}); }, fn + "options.hashes: expected >= 1; got 0");
  expect_error<ValueError>([&] { lsh_attention_forward(q, v, {.chunk = 0}); }, fn + "options.chunk: expected >= 1; got 0");
  expect_error<ShapeError>([&] { lsh_attention_forward(q, random_tensor({2, 9, 3}, 2)); },
                 fn + "value: expected the leading dims (2, 10) of query (2, 10, 4); got (2, 9, 3)");
  expect_error<DtypeError>([&] { lsh_attention_forward(q, v.to(DType::float32)); }, fn + "value: expected query's dtype float64; got float32");
  expect_error<DtypeError>([&] { lsh_buckets(q.to(DType::int64)); }, "[mha::lsh_buckets] query: expected float32 or float64; got int64");
  LshOutput f = lsh_attention_forward(q, v);
  expect_error<ShapeError>([&] { lsh_attention_backward(q, q, v, f); }, "[mha::lsh_attention_backward] dout: expected shape (2, 10, 3); got (2, 10, 4)");
}
