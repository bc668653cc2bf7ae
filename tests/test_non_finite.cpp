// A NaN or infinity in Q, K or V reaches exactly the outputs and gradients
// that depend on it, on the reference path and on the fused path on every
// instruction set (forced in turn); only the mask decides what is masked.
//
// Expected pattern for a NaN, with A(i) the keys that the mask, causality and
// the window allow query row i (rows of the key's head group under GQA):
//   in q[i, c]: rows R = {i} (none when A(i) is empty)
//   in k[j, c] or v[j, c]: rows R = {i : j ∈ A(i)}
//   out[R, :] (v: out[R, c] only), lse[R] (not for v), dq[R, :],
//   dk[j', :] for j' ∈ A(i), i ∈ R, and dv[j', :] likewise (not for v).
// Everything else equals the result on the clean inputs.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <optional>
#include <random>
#include <tuple>

#include "cpu/flash/dispatch.h"
#include "testing.h"

using namespace mha;
using namespace mha::testing;

namespace {

struct Case {
  std::string name;
  Shape q, k, v;
  AttentionOptions options;
  bool transposed_query = false;  // a non-contiguous query view
};

std::vector<Case> cases() {
  const Shape q{2, 2, 5, 3}, k{2, 2, 7, 3}, v{2, 2, 7, 4};
  std::vector<Case> c;
  c.push_back({"plain", q, k, v, {}});
  c.push_back({"causal", q, k, v, {.causal = Causal::top_left}});
  c.push_back({"causal_bottom_right", q, k, v, {.causal = Causal::bottom_right}});
  c.push_back({"window", q, k, v, {.window_left = 1, .window_right = 1}});
  c.push_back({"dropout", q, k, v, {.causal = Causal::top_left, .dropout_p = 0.3, .dropout_seed = 5}});
  c.push_back({"gqa", {2, 4, 5, 3}, k, v, {.causal = Causal::bottom_right}});
  c.push_back({"transposed_query", q, k, v, {}, true});
  // A bool mask with a fully masked row, and an additive mask with -inf.
  std::vector<bool> allowed;
  for (int64_t i = 0; i < 5; ++i)
    for (int64_t j = 0; j < 7; ++j) allowed.push_back(i != 2 && (i + 2 * j) % 3 != 0);
  c.push_back({"bool_mask", q, k, v, {.mask = Tensor::from_bools(allowed, {5, 7})}});
  Tensor additive = random_tensor({2, 1, 5, 7}, 9, DType::float32);
  for (int64_t j = 0; j < 7; j += 3) additive.set_item({1, 0, 1, j}, -INFINITY);
  for (int64_t j = 0; j < 7; ++j) additive.set_item({0, 0, 4, j}, -INFINITY);
  c.push_back({"additive_mask", q, k, v, {.mask = additive}});
  return c;
}

struct Results {
  std::vector<double> out, lse, dq, dk, dv;
};

Results run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, AttentionOptions o) {
  const AttentionOutput f = attention_forward(q, k, v, o);
  const AttentionGradients g = attention_backward(dout, q, k, v, f, o);
  return {f.out.to_vector(), f.lse.to_vector(), g.dquery.to_vector(), g.dkey.to_vector(), g.dvalue.to_vector()};
}

Tensor make_query(const Case& c, DType dtype) {
  if (!c.transposed_query) return random_tensor(c.q, 1, dtype);
  // (B, L, H, E) storage seen as (B, H, L, E).
  return random_tensor({c.q[0], c.q[2], c.q[1], c.q[3]}, 1, dtype).transpose(1, 2);
}

// Compares one run against the expected pattern; returns the number of mismatches
// (the first few are reported).
struct Checker {
  const Results& clean;
  double tol;
  int reported = 0;
  int64_t mismatches = 0;

  void check(const char* what, const std::vector<double>& got, const std::vector<double>& want,
             const std::vector<uint8_t>& expect_nan, const std::string& where, bool lse) {
    for (size_t x = 0; x < got.size(); ++x) {
      const double g = got[x];
      bool ok;
      if (expect_nan[x]) ok = lse ? std::isnan(g) : !std::isfinite(g);
      else if (std::isfinite(want[x])) ok = std::abs(g - want[x]) <= tol * (1 + std::abs(want[x]));
      else ok = g == want[x];  // -inf lse of a fully masked row
      if (!ok) {
        ++mismatches;
        if (reported++ < 8)
          ADD_FAILURE() << where << ": " << what << "[" << x << "] = " << g << ", expected "
                        << (expect_nan[x] ? "non-finite" : std::to_string(want[x]));
      }
    }
  }

  // Every result against `clean` taken as the truth: non-finite where it is
  // (an lse of -inf, a fully masked row, counts as a value), close elsewhere.
  // Returns the number of non-finite values expected.
  int64_t check_like(const Results& got, const std::string& where) {
    int64_t expected = 0;
    const auto nonfinite = [&](const std::vector<double>& y) {
      std::vector<uint8_t> m(y.size());
      for (size_t i = 0; i < y.size(); ++i) expected += (m[i] = !std::isfinite(y[i]) && y[i] != -INFINITY);
      return m;
    };
    check("out", got.out, clean.out, nonfinite(clean.out), where, false);
    check("lse", got.lse, clean.lse, nonfinite(clean.lse), where, true);
    check("dq", got.dq, clean.dq, nonfinite(clean.dq), where, false);
    check("dk", got.dk, clean.dk, nonfinite(clean.dk), where, false);
    check("dv", got.dv, clean.dv, nonfinite(clean.dv), where, false);
    return expected;
  }
};

class NonFinite : public ::testing::TestWithParam<std::optional<cpu::Isa>> {
 protected:
  void SetUp() override {
    if (GetParam()) cpu::force_isa(*GetParam());
  }
  void TearDown() override { cpu::force_isa(std::nullopt); }
  AttentionPath path() const { return GetParam() ? AttentionPath::fused : AttentionPath::reference; }
};

std::string param_name(const ::testing::TestParamInfo<std::optional<cpu::Isa>>& info) {
  return info.param ? "fused_" + cpu::to_string(*info.param) : std::string("reference");
}

// Sizes of a (B, Hq, L, E) × (B, Hk, S, E) × (B, Hk, S, Ev) call.
struct Dims {
  int64_t B, Hq, L, E, Hk, S, Ev;
};

Dims dims_of(const Tensor& q, const Tensor& k, const Tensor& v) {
  return {q.size(0), q.size(1), q.size(2), q.size(3), k.size(1), k.size(2), v.size(3)};
}

using Allowed = std::function<bool(int64_t b, int64_t hq, int64_t i, int64_t j)>;
using Run = std::function<Results(const Tensor& q, const Tensor& k, const Tensor& v)>;

// Sets one element of each input in turn to NaN (q, k, v; or, with
// `inputs` = 2, only q and v, q standing for the keys too) and checks every
// output and gradient against the pattern above. `make_q` remakes the query
// (a non-contiguous view, say). Returns the number of runs.
int64_t check_nan_pattern(const Run& run, const std::function<Tensor()>& make_q, const Tensor& k, const Tensor& v,
                          const Allowed& allowed, double tol) {
  const Tensor q = make_q();
  const Dims n = dims_of(q, k, v);
  const int64_t group = n.Hq / n.Hk;
  const Results clean = run(q, k, v);
  Checker checker{clean, tol};
  int64_t runs = 0;
  for (int which = 0; which < 3; ++which) {
    const Tensor& src = which == 0 ? q : which == 1 ? k : v;
    for (int64_t b = 0; b < n.B; ++b)
      for (int64_t h = 0; h < src.size(1); ++h)
        for (int64_t r = 0; r < src.size(2); ++r)
          for (int64_t col = 0; col < src.size(3); ++col) {
            Tensor bad = which == 0 ? make_q() : src.clone();
            bad.set_item({b, h, r, col}, NAN);
            const Results got = run(which == 0 ? bad : q, which == 1 ? bad : k, which == 2 ? bad : v);
            ++runs;
            std::vector<std::pair<int64_t, int64_t>> rows;  // (hq, i) that read the element
            if (which == 0) {
              bool any = false;
              for (int64_t j = 0; j < n.S; ++j) any |= allowed(b, h, r, j);
              if (any) rows.push_back({h, r});
            } else {
              for (int64_t hq = h * group; hq < (h + 1) * group; ++hq)
                for (int64_t i = 0; i < n.L; ++i)
                  if (allowed(b, hq, i, r)) rows.push_back({hq, i});
            }
            std::vector<uint8_t> out(clean.out.size()), lse(clean.lse.size()), dq(clean.dq.size()),
                dk(clean.dk.size()), dv(clean.dv.size());
            for (auto [hq, i] : rows) {
              const int64_t row = (b * n.Hq + hq) * n.L + i;
              for (int64_t e = 0; e < n.Ev; ++e)
                if (which != 2 || e == col) out[size_t(row * n.Ev + e)] = 1;
              if (which != 2 && !lse.empty()) lse[size_t(row)] = 1;
              for (int64_t e = 0; e < n.E; ++e) dq[size_t(row * n.E + e)] = 1;
              const int64_t hk = hq / group;
              for (int64_t j = 0; j < n.S; ++j) {
                if (!allowed(b, hq, i, j)) continue;
                for (int64_t e = 0; e < n.E; ++e) dk[size_t(((b * n.Hk + hk) * n.S + j) * n.E + e)] = 1;
                if (which != 2)
                  for (int64_t e = 0; e < n.Ev; ++e) dv[size_t(((b * n.Hk + hk) * n.S + j) * n.Ev + e)] = 1;
              }
            }
            const std::string where = std::string("NaN in ") + "qkv"[which] + "[" + std::to_string(b) + "," +
                                      std::to_string(h) + "," + std::to_string(r) + "," + std::to_string(col) + "]";
            checker.check("out", got.out, clean.out, out, where, false);
            checker.check("lse", got.lse, clean.lse, lse, where, true);
            checker.check("dq", got.dq, clean.dq, dq, where, false);
            checker.check("dk", got.dk, clean.dk, dk, where, false);
            checker.check("dv", got.dv, clean.dv, dv, where, false);
          }
  }
  EXPECT_EQ(checker.mismatches, 0);
  return runs;
}

TEST_P(NonFinite, ANaNReachesExactlyTheOutputsThatDependOnIt) {
  int64_t runs = 0;
  for (DType dtype : {DType::float32, DType::bfloat16})
    for (const Case& c : cases()) {
      if (dtype == DType::bfloat16 && c.name != "plain" && c.name != "causal" && c.name != "gqa") continue;
      SCOPED_TRACE(c.name + " " + to_string(dtype));
      AttentionOptions o = c.options;
      o.path = path();
      const Tensor q = make_query(c, dtype), k = random_tensor(c.k, 2, dtype), v = random_tensor(c.v, 3, dtype);
      const Tensor dout = random_tensor({c.q[0], c.q[1], c.q[2], c.v[3]}, 4, dtype);
      const Dims n = dims_of(q, k, v);
      // A(b, hq, i, j): the reference weights without dropout are > 0 exactly where allowed.
      AttentionOptions plain = c.options;
      plain.dropout_p = 0, plain.return_weights = true, plain.path = AttentionPath::reference;
      const std::vector<double> w = attention_forward(q, k, v, plain).weights.to_vector();
      const Allowed allowed = [&](int64_t b, int64_t hq, int64_t i, int64_t j) {
        return w[size_t(((b * n.Hq + hq) * n.L + i) * n.S + j)] > 0;
      };
      runs += check_nan_pattern([&](const Tensor& qq, const Tensor& kk, const Tensor& vv) { return run(qq, kk, vv, dout, o); },
                                [&] { return make_query(c, dtype); }, k, v, allowed,
                                dtype == DType::bfloat16 ? 2e-2 : 2e-5);
    }
  std::printf("%lld inputs with one NaN element checked on %s\n", (long long)runs, param_name({GetParam(), 0}).c_str());
}

// ±inf: the fused path gives what the reference path gives, non-finite where
// it is non-finite and the same values elsewhere.
TEST(NonFiniteFused, InfinitiesGiveTheReferenceResults) {
  for (cpu::Isa isa : cpu::supported_isas())
  for (const Case& c : cases()) {
    cpu::force_isa(isa);
    SCOPED_TRACE(c.name + " on " + cpu::to_string(isa));
    AttentionOptions fused = c.options, reference = c.options;
    fused.path = AttentionPath::fused, reference.path = AttentionPath::reference;
    const Tensor q = make_query(c, DType::float32), k = random_tensor(c.k, 2, DType::float32),
                 v = random_tensor(c.v, 3, DType::float32);
    const Tensor dout = random_tensor({c.q[0], c.q[1], c.q[2], c.v[3]}, 4, DType::float32);
    std::mt19937_64 rng(7);
    for (int trial = 0; trial < 24; ++trial) {
      const int which = trial % 3;
      Tensor bad = which == 0 ? make_query(c, DType::float32) : (which == 1 ? k : v).clone();
      const Shape idx{int64_t(rng() % uint64_t(bad.size(0))), int64_t(rng() % uint64_t(bad.size(1))),
                      int64_t(rng() % uint64_t(bad.size(2))), int64_t(rng() % uint64_t(bad.size(3)))};
      bad.set_item(idx, trial % 2 ? INFINITY : -INFINITY);
      const Tensor& qq = which == 0 ? bad : q;
      const Tensor& kk = which == 1 ? bad : k;
      const Tensor& vv = which == 2 ? bad : v;
      const Results want = run(qq, kk, vv, dout, reference), got = run(qq, kk, vv, dout, fused);
      Checker checker{want, 2e-5};
      checker.check_like(got, std::string("inf in ") + "qkv"[which] + " trial " + std::to_string(trial));
      EXPECT_EQ(checker.mismatches, 0);
    }
  }
  cpu::force_isa(std::nullopt);
}

// A row whose allowed logits are all -inf from the data is NaN (exp(-inf - (-inf))),
// not an empty row: only the mask empties a row.
TEST_P(NonFinite, OnlyTheMaskEmptiesARow) {
  AttentionOptions o{.path = path()};
  Tensor q = Tensor::full({1, 1, 2, 2}, 1.0), k = Tensor::full({1, 1, 3, 2}, 1.0), v = Tensor::full({1, 1, 3, 2}, 1.0);
  q.set_item({0, 0, 0, 0}, -INFINITY);  // row 0: every logit -inf
  const AttentionOutput f = attention_forward(q, k, v, o);
  EXPECT_TRUE(std::isnan(f.lse.item({0, 0, 0})));
  EXPECT_TRUE(std::isnan(f.out.item({0, 0, 0, 0})));
  EXPECT_NEAR(f.out.item({0, 0, 1, 0}), 1.0, 1e-6);
  // The same row emptied by the mask: output 0, lse -inf, and the infinite query changes nothing.
  o.mask = Tensor::from_bools({false, false, false, true, true, true}, {2, 3});
  const AttentionOutput m = attention_forward(q, k, v, o);
  EXPECT_EQ(m.lse.item({0, 0, 0}), -INFINITY);
  EXPECT_EQ(m.out.item({0, 0, 0, 0}), 0.0);
  const AttentionGradients g = attention_backward(Tensor::full({1, 1, 2, 2}, 1.0), q, k, v, m, o);
  EXPECT_TRUE(all_finite(g.dquery) && all_finite(g.dkey) && all_finite(g.dvalue));
}

std::vector<std::optional<cpu::Isa>> params_with_reference() {
  std::vector<std::optional<cpu::Isa>> p{std::nullopt};
  for (cpu::Isa isa : cpu::supported_isas()) p.push_back(isa);
  return p;
}

// ---- The variants ------------------------------------------------------------

// Inputs of the variants: (B, H, L, E) with L = S, no head groups.
struct VariantInputs {
  Tensor q, k, v, dout;
  explicit VariantInputs(int64_t L = 7, int64_t E = 3)
      : q(random_tensor({2, 2, L, E}, 1, DType::float32)), k(random_tensor({2, 2, L, E}, 2, DType::float32)),
        v(random_tensor({2, 2, L, 4}, 3, DType::float32)), dout(random_tensor({2, 2, L, 4}, 4, DType::float32)) {}
};

TEST(NonFiniteVariants, BlockSparseIsExact) {
  const VariantInputs x;
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    const BlockSparseOptions o{.layout = strided_layout(7, {.block = 2, .local_blocks = 1, .stride_blocks = 2}, causal),
                               .causal = causal};
    const std::vector<double> mask = block_sparse_mask(o.layout, 7, 7, causal).to_vector();
    check_nan_pattern(
        [&](const Tensor& q, const Tensor& k, const Tensor& v) {
          const BlockSparseOutput f = block_sparse_attention_forward(q, k, v, o);
          const AttentionGradients g = block_sparse_attention_backward(x.dout, q, k, v, f, o);
          return Results{f.out.to_vector(), f.lse.to_vector(), g.dquery.to_vector(), g.dkey.to_vector(),
                         g.dvalue.to_vector()};
        },
        [&] { return x.q.clone(); }, x.k, x.v, [&](int64_t, int64_t, int64_t i, int64_t j) { return mask[size_t(i * 7 + j)] != 0; },
        2e-5);
  }
}

// Linear attention and Performer: the normaliser stands where the lse stands.
// Performer's normaliser carries a stabiliser, the largest exponent over all
// keys, which cancels in out but not in the normaliser itself: only whether
// it is NaN is compared there (stabilised = true).
template <class Options, class Forward, class Backward>
void check_feature_map(const Options& o, bool stabilised, Forward forward, Backward backward) {
  const VariantInputs x;
  check_nan_pattern(
      [&](const Tensor& q, const Tensor& k, const Tensor& v) {
        const LinearAttentionOutput f = forward(q, k, v, o);
        const AttentionGradients g = backward(x.dout, q, k, v, f, o);
        std::vector<double> den = f.normalizer.to_vector();
        if (stabilised)
          for (double& d : den) d = std::isnan(d) ? d : 0.0;
        return Results{f.out.to_vector(), den, g.dquery.to_vector(), g.dkey.to_vector(), g.dvalue.to_vector()};
      },
      [&] { return x.q.clone(); }, x.k, x.v,
      [&](int64_t, int64_t, int64_t i, int64_t j) { return !o.causal || j <= i; }, 2e-5);
}

TEST(NonFiniteVariants, LinearAttentionIsExact) {
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    check_feature_map(LinearAttentionOptions{.causal = causal}, false,
                      [](auto&&... a) { return linear_attention_forward(a...); },
                      [](auto&&... a) { return linear_attention_backward(a...); });
  }
}

TEST(NonFiniteVariants, PerformerIsExact) {
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    check_feature_map(PerformerOptions{.features = performer_features(6, 3, 5), .causal = causal}, true,
                      [](auto&&... a) { return performer_attention_forward(a...); },
                      [](auto&&... a) { return performer_attention_backward(a...); });
  }
}

// Linformer's projections mix every key and value into each projected row:
// every output depends on every key and value.
TEST(NonFiniteVariants, LinformerIsExactOnEveryPath) {
  const VariantInputs x;
  for (auto isa : params_with_reference()) {
    SCOPED_TRACE(isa ? cpu::to_string(*isa) : "reference");
    if (isa) cpu::force_isa(*isa);
    const LinformerOptions o{.key_projection = linformer_projection(3, 7, 1, DType::float32),
                             .value_projection = linformer_projection(3, 7, 2, DType::float32),
                             .path = isa ? AttentionPath::fused : AttentionPath::reference};
    check_nan_pattern(
        [&](const Tensor& q, const Tensor& k, const Tensor& v) {
          const LinformerOutput f = linformer_attention_forward(q, k, v, o);
          const LinformerGradients g = linformer_attention_backward(x.dout, q, k, v, f, o);
          return Results{f.out.to_vector(), f.lse.to_vector(), g.dquery.to_vector(), g.dkey.to_vector(),
                         g.dvalue.to_vector()};
        },
        [&] { return x.q.clone(); }, x.k, x.v, [](int64_t, int64_t, int64_t, int64_t) { return true; }, 2e-5);
    cpu::force_isa(std::nullopt);
  }
}

// Axial attention is two passes of attention: the fused passes give what the
// reference passes give, NaN for NaN, on every instruction set.
TEST(NonFiniteVariants, AxialFusedEqualsReference) {
  const Tensor q = random_tensor({1, 2, 3, 4, 3}, 1, DType::float32), k = random_tensor({1, 2, 3, 4, 3}, 2, DType::float32),
               v = random_tensor({1, 2, 3, 4, 2}, 3, DType::float32), dout = random_tensor({1, 2, 3, 4, 2}, 4, DType::float32);
  const auto run_axial = [&](const Tensor& qq, const Tensor& kk, const Tensor& vv, AttentionPath path) {
    const AxialOptions o{.path = path};
    const AxialOutput f = axial_attention_forward(qq, kk, vv, o);
    const AttentionGradients g = axial_attention_backward(dout, qq, kk, vv, f, o);
    return Results{f.out.to_vector(), {}, g.dquery.to_vector(), g.dkey.to_vector(), g.dvalue.to_vector()};
  };
  int64_t nan_outputs = 0;
  for (cpu::Isa isa : cpu::supported_isas()) {
    cpu::force_isa(isa);
    for (int which = 0; which < 3; ++which)
      for (int64_t x = 0; x < (which == 2 ? v : q).numel(); x += 5) {
        Tensor bad = (which == 0 ? q : which == 1 ? k : v).clone();
        bad.view({-1}).set_item({x}, NAN);
        const Tensor& qq = which == 0 ? bad : q;
        const Tensor& kk = which == 1 ? bad : k;
        const Tensor& vv = which == 2 ? bad : v;
        const Results want = run_axial(qq, kk, vv, AttentionPath::reference), got = run_axial(qq, kk, vv, AttentionPath::fused);
        Checker checker{want, 2e-5};
        nan_outputs += checker.check_like(got, std::string("NaN in ") + "qkv"[which] + " element " + std::to_string(x));
        EXPECT_EQ(checker.mismatches, 0);
      }
  }
  cpu::force_isa(std::nullopt);
  EXPECT_GT(nan_outputs, 0);
}

// LSH: the keys each query reads come from the buckets — its sorted chunk and
// the one before in each round, itself excluded (causal: earlier positions
// only); a query with none reads its own value. The query is its own key's
// source (k = q / |q|), so a NaN in q_j reaches the rows that read key j and
// row j itself, and through dk and the normalisation the dq of the keys those
// rows read. A NaN query also hashes anywhere: its run has other buckets than
// the clean one, so there only the pattern is checked, not the values.
TEST(NonFiniteVariants, LshIsExact) {
  const int64_t L = 12, E = 3, Ev = 2;
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    const LshOptions o{.buckets = 4, .hashes = 2, .chunk = 3, .causal = causal};
    const Tensor q = random_tensor({1, L, E}, 1, DType::float32), v = random_tensor({1, L, Ev}, 2, DType::float32),
                 dout = random_tensor({1, L, Ev}, 3, DType::float32);
    const auto reads = [&](const Tensor& qq) {  // reads[i][j]: query i reads key j
      const std::vector<double> h = lsh_buckets(qq, o).to_vector();
      std::vector<std::vector<uint8_t>> r(L, std::vector<uint8_t>(L, 0));
      for (int64_t round = 0; round < o.hashes; ++round) {
        std::vector<int64_t> order(L);
        for (int64_t i = 0; i < L; ++i) order[size_t(i)] = i;
        std::stable_sort(order.begin(), order.end(),
                         [&](int64_t a, int64_t b) { return h[size_t(round * L + a)] < h[size_t(round * L + b)]; });
        const int64_t chunks = (L + o.chunk - 1) / o.chunk;
        for (int64_t p = 0; p < L; ++p)
          for (int64_t sc : {p / o.chunk, (p / o.chunk + chunks - 1) % chunks})
            for (int64_t x = sc * o.chunk; x < std::min(L, (sc + 1) * o.chunk); ++x) {
              const int64_t i = order[size_t(p)], j = order[size_t(x)];
              if (j != i && (!causal || j < i)) r[size_t(i)][size_t(j)] = 1;
            }
      }
      return r;
    };
    const auto none = [](const std::vector<uint8_t>& keys) { return std::find(keys.begin(), keys.end(), 1) == keys.end(); };
    const auto run = [&](const Tensor& qq, const Tensor& vv) {
      const LshOutput f = lsh_attention_forward(qq, vv, o);
      const LshGradients g = lsh_attention_backward(dout, qq, vv, f, o);
      return Results{f.out.to_vector(), f.lse.to_vector(), g.dquery.to_vector(), {}, g.dvalue.to_vector()};
    };
    const Results clean = run(q, v);
    Checker checker{clean, 2e-5};
    for (int which : {0, 2})
      for (int64_t j = 0; j < L; ++j)
        for (int64_t col = 0; col < (which == 0 ? E : Ev); ++col) {
          Tensor bad = (which == 0 ? q : v).clone();
          bad.set_item({0, j, col}, NAN);
          const Results got = run(which == 0 ? bad : q, which == 2 ? bad : v);
          const auto r = reads(which == 0 ? bad : q);
          std::vector<uint8_t> out(static_cast<size_t>(L * Ev)), lse(static_cast<size_t>(L)), dq(static_cast<size_t>(L * E)),
              dv(static_cast<size_t>(L * Ev));
          std::vector<int64_t> rows;  // whose dS is NaN
          for (int64_t i = 0; i < L; ++i)
            if (r[size_t(i)][size_t(j)] || (which == 0 && i == j && !none(r[size_t(i)]))) rows.push_back(i);
          for (int64_t i : rows) {
            for (int64_t e = 0; e < Ev; ++e)
              if (which == 0 || e == col) out[size_t(i * Ev + e)] = 1;
            if (which == 0) lse[size_t(i)] = 1;
            for (int64_t e = 0; e < E; ++e) dq[size_t(i * E + e)] = 1;
            for (int64_t k = 0; k < L; ++k) {
              if (!r[size_t(i)][size_t(k)]) continue;
              for (int64_t e = 0; e < E; ++e) dq[size_t(k * E + e)] = 1;  // through dk_k
              if (which == 0)
                for (int64_t e = 0; e < Ev; ++e) dv[size_t(k * Ev + e)] = 1;
            }
          }
          if (which == 0) {  // |q_j| is NaN: its own lse (scale·|q_j| when it reads nothing) and dq
            lse[size_t(j)] = 1;
            for (int64_t e = 0; e < E; ++e) dq[size_t(j * E + e)] = 1;
          } else if (none(r[size_t(j)])) {
            out[size_t(j * Ev + col)] = 1;  // out_j = v_j
          }
          const std::string where = std::string("NaN in ") + (which ? "v" : "q") + "[" + std::to_string(j) + "," +
                                    std::to_string(col) + "]";
          if (which == 0) {  // other buckets: the pattern only
            for (auto [name, x, m] : {std::tuple{"out", &got.out, &out}, {"lse", &got.lse, &lse}, {"dq", &got.dq, &dq},
                                      {"dv", &got.dv, &dv}})
              for (size_t y = 0; y < x->size(); ++y)
                EXPECT_EQ(!std::isfinite((*x)[y]), bool((*m)[y])) << where << " " << name << "[" << y << "]";
            continue;
          }
          checker.check("out", got.out, clean.out, out, where, false);
          checker.check("lse", got.lse, clean.lse, lse, where, true);
          checker.check("dq", got.dq, clean.dq, dq, where, false);
          checker.check("dv", got.dv, clean.dv, dv, where, false);
        }
    EXPECT_EQ(checker.mismatches, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, NonFinite, ::testing::ValuesIn(params_with_reference()), param_name);

}  // namespace
