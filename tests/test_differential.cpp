// The differential sweep: 10,000 random attention calls, the fused path
// against the reference path, forward and backward — shapes, bool, additive
// and broadcast masks, both causal alignments, windows, GQA and MQA, dropout,
// float32 and bfloat16, non-contiguous inputs — on every instruction set in
// turn. 0 mismatches and 0 NaN; the counts are printed.
#include <cstdio>
#include <cstdlib>
#include <random>

#include "cpu/flash/dispatch.h"
#include "testing.h"

using namespace mha;
using namespace mha::testing;

namespace {

struct Draw {
  std::mt19937_64 rng;
  int64_t uniform(int64_t lo, int64_t hi) { return lo + int64_t(rng() % uint64_t(hi - lo + 1)); }
  bool chance(double p) { return double(rng() % 1000000) < p * 1e6; }
};

struct Case {
  Tensor q, k, v, dout;
  AttentionOptions options;
  std::string text;  // to reproduce a failure
};

// A (lead…, H, R, C) tensor, random; non-contiguous when asked: made as
// (lead…, R, H, C) and transposed, or with every other column.
Tensor input(const Shape& lead, int64_t H, int64_t R, int64_t C, DType dtype, bool strided, uint64_t seed) {
  Shape shape = lead;
  if (!strided) {
    shape.insert(shape.end(), {H, R, C});
    return random_tensor(shape, seed, dtype);
  }
  if (seed % 2) {
    shape.insert(shape.end(), {R, H, C});
    const int64_t d = int64_t(shape.size());
    return random_tensor(shape, seed, dtype).transpose(d - 3, d - 2);
  }
  shape.insert(shape.end(), {H, R, 2 * C});
  return random_tensor(shape, seed, dtype).slice(-1, 0, 2 * C, 2);
}

Case draw(Draw& d, uint64_t seed) {
  Case c;
  const DType dtype = d.chance(0.2) ? DType::bfloat16 : DType::float32;
  const int64_t B = d.uniform(1, 3), Hk = d.uniform(1, 3), Hq = Hk * (d.chance(0.4) ? d.uniform(1, 3) : 1);
  const bool mqa = d.chance(0.1);
  const int64_t big = d.chance(0.1);
  const int64_t L = d.uniform(1, big ? 150 : 40), S = d.chance(0.2) ? L : d.uniform(1, big ? 150 : 40);
  const int64_t E = d.chance(0.1) ? (d.chance(0.5) ? 64 : 80) : d.uniform(1, 36);
  const int64_t Ev = d.chance(0.5) ? E : d.uniform(1, 36);
  const bool broadcast_kv = d.chance(0.15);  // key and value without the batch dim
  const bool strided = d.chance(0.25);
  c.q = input({B}, Hq, L, E, dtype, strided && d.chance(0.7), seed * 4 + 1);
  const Shape kv_lead = broadcast_kv ? Shape{} : Shape{B};
  c.k = input(kv_lead, mqa ? 1 : Hk, S, E, dtype, strided && d.chance(0.7), seed * 4 + 2);
  c.v = input(kv_lead, mqa ? 1 : Hk, S, Ev, dtype, strided && d.chance(0.7), seed * 4 + 3);
  c.dout = random_tensor({B, Hq, L, Ev}, seed * 4 + 4, dtype);
  AttentionOptions& o = c.options;
  Generator g(seed);
  std::string mask = "none";
  switch (d.uniform(0, 6)) {
    case 0: o.mask = rand_bool({B, Hq, L, S}, g, 0.7), mask = "bool (B,H,L,S)"; break;
    case 1: o.mask = rand_bool({B, 1, 1, S}, g, 0.8), mask = "bool key padding"; break;
    case 2: o.mask = rand_bool({L, S}, g, 0.5), mask = "bool (L,S)"; break;
    case 3: o.mask = randn({Hq, 1, S}, g), mask = "additive (H,1,S)"; break;
    case 4: {  // additive with -inf, some rows fully masked
      Tensor m = randn({L, S}, g);
      for (int64_t i = 0; i < L; ++i)
        for (int64_t j = 0; j < S; ++j)
          if ((i * 7 + j * 3 + int64_t(seed)) % 5 == 0 || i % 9 == 4) m.set_item({i, j}, -INFINITY);
      o.mask = m, mask = "additive (L,S) with -inf";
      break;
    }
    default: break;
  }
  o.causal = d.chance(0.3) ? (d.chance(0.5) ? Causal::top_left : Causal::bottom_right) : Causal::none;
  if (d.chance(0.2)) o.window_left = d.uniform(0, 8);
  if (d.chance(0.15)) o.window_right = d.uniform(0, 8);
  if (d.chance(0.2)) o.dropout_p = d.chance(0.5) ? 0.1 : 0.5, o.dropout_seed = seed;
  if (d.chance(0.1)) o.scale = 0.05 + double(d.uniform(0, 100)) / 50;
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "case %llu: %s q %s k %s v %s%s, mask %s, causal %d, window (%lld, %lld), dropout %.1f, scale %s",
                (unsigned long long)seed, to_string(dtype).c_str(), shape_string(c.q.shape()).c_str(),
                shape_string(c.k.shape()).c_str(), shape_string(c.v.shape()).c_str(), strided ? " (strided)" : "",
                mask.c_str(), int(o.causal), (long long)o.window_left, (long long)o.window_right, o.dropout_p,
                o.scale ? std::to_string(*o.scale).c_str() : "default");
  c.text = buf;
  return c;
}

// Largest |a - b| over max(1, |b|) elementwise-normalised by the result's size; NaN counted apart.
struct Compare {
  int64_t nan = 0;
  bool ok = true;
  void check(const Tensor& fused, const Tensor& reference, double tol, bool lse) {
    const std::vector<double> a = fused.to_vector(), b = reference.to_vector();
    double scale = 1;
    for (double y : b)
      if (std::isfinite(y)) scale = std::max(scale, std::abs(y));
    for (size_t i = 0; i < a.size(); ++i) {
      if (std::isnan(a[i]) || (!lse && std::isinf(a[i]))) ++nan, ok = false;
      else if (std::isinf(b[i]) || std::isinf(a[i])) ok &= a[i] == b[i];  // -inf lse: a fully masked row
      else ok &= std::abs(a[i] - b[i]) <= tol * (lse ? std::max(1.0, std::abs(b[i])) : scale);
    }
  }
};

}  // namespace

TEST(Differential, FusedEqualsReferenceOnTenThousandRandomCases) {
  // MHA_DIFFERENTIAL_CASES: fewer under the sanitizers (scripts/test.sh), where each case costs 25× more.
  const char* env = std::getenv("MHA_DIFFERENTIAL_CASES");
  const int64_t cases = env ? std::max<int64_t>(1, std::atoll(env)) : 10000;
  const std::vector<cpu::Isa> isas = cpu::supported_isas();
  Draw d{std::mt19937_64(20261201)};
  int64_t mismatches = 0, nans = 0, fused_runs = 0, reported = 0;
  std::vector<int64_t> per_isa(isas.size(), 0);
  for (int64_t n = 0; n < cases; ++n) {
    const Case c = draw(d, uint64_t(n));
    cpu::force_isa(isas[size_t(n) % isas.size()]);
    ++per_isa[size_t(n) % isas.size()];
    AttentionOptions fused = c.options, reference = c.options;
    fused.path = AttentionPath::fused, reference.path = AttentionPath::reference;
    const AttentionOutput a = attention_forward(c.q, c.k, c.v, fused), b = attention_forward(c.q, c.k, c.v, reference);
    fused_runs += a.path == AttentionPath::fused;  // finite inputs never fall back
    const AttentionGradients ga = attention_backward(c.dout, c.q, c.k, c.v, a, fused),
                             gb = attention_backward(c.dout, c.q, c.k, c.v, b, reference);
    const double tol = c.q.dtype() == DType::bfloat16 ? 2e-2 : 2e-5;
    Compare cmp;
    cmp.check(a.out, b.out, tol, false);
    cmp.check(a.lse, b.lse, 1e-4, true);
    cmp.check(ga.dquery, gb.dquery, 5 * tol, false);
    cmp.check(ga.dkey, gb.dkey, 5 * tol, false);
    cmp.check(ga.dvalue, gb.dvalue, 5 * tol, false);
    nans += cmp.nan;
    if (!cmp.ok) {
      ++mismatches;
      if (reported++ < 10) ADD_FAILURE() << "mismatch on " << cpu::to_string(cpu::active_isa()) << ": " << c.text;
    }
  }
  cpu::force_isa(std::nullopt);
  std::string split;
  for (size_t i = 0; i < isas.size(); ++i) {
    if (i) split.append(", ");
    split.append(cpu::to_string(isas[i])).append(" ").append(std::to_string(per_isa[i]));
  }
  std::printf("differential sweep: %lld cases (%s), forward and backward, %lld mismatches, %lld NaN\n",
              (long long)cases, split.c_str(), (long long)mismatches, (long long)nans);
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(nans, 0);
  EXPECT_EQ(fused_runs, cases);
}
