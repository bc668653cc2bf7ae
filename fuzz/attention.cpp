// Fuzzes the attention API: shapes, strides, masks and options decoded from
// the input, values drawn from a seed in it with a few NaN, ±inf or huge
// entries planted. Invalid combinations must be refused with a typed error;
// valid ones must give, on the fused path (on an instruction set the input
// picks), NaN where the reference path has NaN and elsewhere values as close
// to the reference path in float64 as the reference path's own (see
// compare), forward and backward.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/flash/dispatch.h"
#include "fuzz.h"
#include "mha/attention.h"
#include "mha/random.h"

namespace {

using namespace mha;

std::string planted;  // the planted values, for the message

// (lead, H, R, C), contiguous or a transposed or strided view.
Tensor input(FuzzedDataProvider& in, int64_t lead, int64_t H, int64_t R, int64_t C, DType dtype, Generator& gen) {
  const int layout = in.ConsumeIntegralInRange(0, 2);
  Tensor t;
  if (layout == 0) t = randn({lead, H, R, C}, gen, 0.0, 1.0, dtype);
  else if (layout == 1) t = randn({lead, R, H, C}, gen, 0.0, 1.0, dtype).transpose(1, 2);
  else t = randn({lead, H, R, 2 * C}, gen, 0.0, 1.0, dtype).slice(-1, 0, 2 * C, 2);
  // A few planted values: NaN, ±inf, huge logits.
  for (int n = in.ConsumeIntegralInRange(0, 2); n > 0; --n) {
    const double values[] = {NAN, INFINITY, -INFINITY, 1e4, -1e4, 0.0};
    const Shape at{in.ConsumeIntegralInRange<int64_t>(0, lead - 1), in.ConsumeIntegralInRange<int64_t>(0, H - 1),
                   in.ConsumeIntegralInRange<int64_t>(0, R - 1), in.ConsumeIntegralInRange<int64_t>(0, C - 1)};
    const double value = values[in.ConsumeIntegralInRange(0, 5)];
    t.set_item(at, value);
    planted += " " + std::to_string(value) + " at " + shape_string(at) + " of " + shape_string(t.shape()) + ";";
  }
  return t;
}

// t with each element moved by 2^-22 of itself, up or down by its position
// (float32; bfloat16 would round it away, and its tolerance covers it).
Tensor moved_by_ulps(const Tensor& t) {
  if (t.dtype() != DType::float32) return t;
  Tensor m = t.contiguous().clone();
  float* x = m.data<float>();
  for (int64_t i = 0; i < m.numel(); ++i) x[i] *= 1.0f + ((i * 7) % 3 - 1) * 0x1p-22f;
  return m;
}

double max_abs(const Tensor& t) {
  double m = 0;
  for (double y : t.to_vector())
    if (std::isfinite(y)) m = std::max(m, std::abs(y));
  return m;
}

// The largest error that a row's output (fused, against exact) brings into
// D = rowsum(dO∘O): the backward computes D from the output as returned, as
// FlashAttention does, and dS = P (dP∘F - D) carries that error to every key
// of the row. The output is held to out's rule (a unit of its dtype, and in
// the bfloat16 kernel P∘F rounded too); where P is one-hot and |dP| huge
// (planted 1e4 in V), exact dS is 0 and this is all there is: a bfloat16
// output 0.4% off made dS 194 at |dP| = 4e4.
double output_error_in_d(const Tensor& fused_out, const Tensor& exact_out, const Tensor& dout, int64_t Ev) {
  const std::vector<double> oa = fused_out.to_vector(), ox = exact_out.to_vector(), g = dout.to_vector();
  double worst = 0;
  for (size_t r = 0; r * size_t(Ev) < oa.size(); ++r) {
    double d = 0;
    for (size_t e = r * size_t(Ev); e < (r + 1) * size_t(Ev); ++e)
      if (std::isfinite(oa[e]) && std::isfinite(ox[e])) d += std::abs(g[e] * (oa[e] - ox[e]));
    worst = std::max(worst, d);
  }
  return worst;
}

std::string described;  // the decoded call, for the finding's message

// The accuracy rule of tests/test_flash.cpp, with the problem's conditioning:
// against the reference path in float64 (x), the fused path (a) errs at most
// twice what the reference path errs in the inputs' dtype (b), plus four times
// how far the reference path moves when q and k move by 2^-22 of themselves
// (bp: planted values of 1e4 make logits of 1e4, whose rounding float32
// gradients multiply by the 1e4 again; that both paths share), plus tol of
// the result's size.
// allowance: what recomputing P from the lse may cost at huge logits (see
// the caller); 0 for ordinary ones.
void compare(const Tensor& fused, const Tensor& reference, const Tensor& moved, const Tensor& exact, double tol,
             double allowance, const char* what) {
  const std::vector<double> a = fused.to_vector(), b = reference.to_vector(), bp = moved.to_vector(),
                            x = exact.to_vector();
  double scale = 1;
  for (double y : x)
    if (std::isfinite(y)) scale = std::max(scale, std::abs(y));
  for (size_t i = 0; i < a.size(); ++i) {
    const double sensitivity = std::isfinite(bp[i] - b[i]) ? std::abs(bp[i] - b[i]) : 0.0;
    // Where the reference path is not finite the fused path must not be either, in the same way (NaN for
    // NaN, the same infinity): float64 may differ there, as where a weight underflows in float32 (0·inf is
    // NaN) but not in float64 (tiny·inf is inf). The reference path's NaN rule is test_non_finite's.
    bool same;
    if (!std::isfinite(b[i])) same = std::isnan(b[i]) ? std::isnan(a[i]) : a[i] == b[i];
    else if (!std::isfinite(x[i])) same = std::isfinite(a[i]) && std::abs(a[i] - b[i]) <= tol * scale + allowance;
    else same = std::isfinite(a[i]) && std::abs(a[i] - x[i]) <= 2 * std::abs(b[i] - x[i]) + 4 * sensitivity + tol * scale + allowance;
    if (!same)
      fuzz::finding(std::string(what) + "[" + std::to_string(i) + "]: fused " + std::to_string(a[i]) + ", reference " +
                    std::to_string(b[i]) + ", float64 " + std::to_string(x[i]) + " in " + described);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  planted.clear();
  Generator gen(in.ConsumeIntegral<uint32_t>());
  const DType dtype = in.ConsumeBool() ? DType::bfloat16 : DType::float32;
  const int64_t B = in.ConsumeIntegralInRange(1, 2), Hk = in.ConsumeIntegralInRange(1, 3);
  // Mostly valid head counts; sometimes one that Hk does not divide (a ShapeError).
  const int64_t Hq = in.ConsumeIntegralInRange(0, 9) ? Hk * in.ConsumeIntegralInRange(1, 3) : in.ConsumeIntegralInRange(1, 5);
  const int64_t L = in.ConsumeIntegralInRange(1, 40), S = in.ConsumeIntegralInRange(1, 40);
  const int64_t E = in.ConsumeIntegralInRange(1, 40), Ev = in.ConsumeIntegralInRange(1, 40);
  const int64_t Ek = in.ConsumeIntegralInRange(0, 9) ? E : in.ConsumeIntegralInRange(1, 40);  // mismatch: ShapeError
  const Tensor q = input(in, B, Hq, L, E, dtype, gen), k = input(in, B, Hk, S, Ek, dtype, gen),
               v = input(in, B, Hk, S, Ev, dtype, gen);
  AttentionOptions o;
  switch (in.ConsumeIntegralInRange(0, 5)) {
    case 1: o.mask = rand_bool({B, Hq, L, S}, gen, in.ConsumeProbability<double>()); break;
    case 2: o.mask = rand_bool({B, 1, 1, S}, gen, in.ConsumeProbability<double>()); break;
    case 3: o.mask = randn({Hq, 1, S}, gen); break;
    case 4: {
      Tensor m = randn({L, S}, gen);
      for (int n = in.ConsumeIntegralInRange(0, 8); n > 0; --n)
        m.set_item({in.ConsumeIntegralInRange<int64_t>(0, L - 1), in.ConsumeIntegralInRange<int64_t>(0, S - 1)},
                   in.ConsumeBool() ? -INFINITY : (in.ConsumeBool() ? NAN : 1e4));  // NaN: a ValueError
      o.mask = m;
      break;
    }
    case 5: o.mask = rand_bool({in.ConsumeIntegralInRange<int64_t>(1, 3), S}, gen, 0.5); break;  // often unbroadcastable
    default: break;
  }
  o.causal = Causal(in.ConsumeIntegralInRange(0, 2));
  o.window_left = in.ConsumeIntegralInRange(-2, 6);  // -2: a ValueError
  o.window_right = in.ConsumeIntegralInRange(-1, 6);
  if (in.ConsumeBool()) o.dropout_p = in.ConsumeFloatingPointInRange(-0.1, 1.0), o.dropout_seed = 3;  // < 0 or 1: ValueError
  if (in.ConsumeBool()) o.scale = in.ConsumeFloatingPoint<double>();  // NaN or inf: ValueError
  const std::vector<cpu::Isa> isas = cpu::supported_isas();
  cpu::force_isa(isas[in.ConsumeIntegralInRange<size_t>(0, isas.size() - 1)]);
  described = to_string(dtype) + " q " + shape_string(q.shape()) + " k " + shape_string(k.shape()) + " v " +
              shape_string(v.shape()) + " mask " + (o.mask.defined() ? shape_string(o.mask.shape()) + " " + to_string(o.mask.dtype()) : "none") +
              " causal " + std::to_string(int(o.causal)) + " window " + std::to_string(o.window_left) + "," +
              std::to_string(o.window_right) + " dropout " + std::to_string(o.dropout_p) + " scale " +
              (o.scale ? std::to_string(*o.scale) : "default") + " on " + cpu::to_string(cpu::active_isa()) + "; planted:" + planted;
  fuzz::refusals_allowed([&] {
    AttentionOptions fused = o, reference = o, exact = o;
    fused.path = AttentionPath::fused, reference.path = exact.path = AttentionPath::reference;
    if (o.mask.defined() && o.mask.dtype() != DType::boolean) exact.mask = o.mask.to(DType::float64);
    const Tensor q64 = q.to(DType::float64), k64 = k.to(DType::float64), v64 = v.to(DType::float64);
    const Tensor qm = moved_by_ulps(q), km = moved_by_ulps(k);
    const AttentionOutput a = attention_forward(q, k, v, fused), b = attention_forward(q, k, v, reference),
                          bm = attention_forward(qm, km, v, reference), x = attention_forward(q64, k64, v64, exact);
    const double tol = dtype == DType::bfloat16 ? 2e-2 : 2e-5;
    // Where a one-hot row makes the reference path exact, the fused path still rounds the way float32 must:
    // its backward recomputes P = exp2(s·c - lse·log2 e) from the saved lse, an error relative to |s| (at
    // logits past 100, planted 1e4 in q, k or an additive mask, δ ≈ 8 ε max|s·c|), and forms dS = P (dP - D) with D in double and dP
    // in float32, an error of 4 ε |dP| (planted 1e4 in V makes dP large). The gradients multiply both by
    // the operands' sizes; with ordinary inputs the allowance stays below tol.
    const double eps = 0x1p-24, sc = o.scale ? std::abs(*o.scale) : 1 / std::sqrt(double(E)), c = sc * 1.4426950408889634;
    const double qmax = max_abs(q), kmax = max_abs(k), vmax = max_abs(v);
    const double masks = o.mask.defined() && o.mask.dtype() != DType::boolean ? max_abs(o.mask) : 0.0;  // 1e4 planted
    const double logits = c * double(E) * qmax * kmax + masks * 1.4426950408889634;
    const double delta = logits > 100 ? 8 * eps * logits : 0.0;
    compare(a.out, b.out, bm.out, x.out, tol, delta * vmax, "out");
    compare(a.lse, b.lse, bm.lse, x.lse, 1e-4, 0.0, "lse");
    const Tensor dout = randn(b.out.shape(), gen, 0.0, 1.0, dtype);
    const AttentionGradients ga = attention_backward(dout, q, k, v, a, fused), gb = attention_backward(dout, q, k, v, b, reference),
                             gm = attention_backward(dout, qm, km, v, bm, reference),
                             gx = attention_backward(dout.to(DType::float64), q64, k64, v64, x, exact);
    // The fused output's own error enters D (output_error_in_d): all there is where P is one-hot.
    const double output_in_d = output_error_in_d(a.out, x.out, dout, Ev);
    const double dmax = max_abs(dout), ds = (delta + 4 * eps) * 2 * double(Ev) * dmax * vmax + 2 * output_in_d;  // dS's error
    compare(ga.dquery, gb.dquery, gm.dquery, gx.dquery, 5 * tol, sc * ds * kmax, "dquery");
    compare(ga.dkey, gb.dkey, gm.dkey, gx.dkey, 5 * tol, sc * ds * double(L) * qmax, "dkey");
    compare(ga.dvalue, gb.dvalue, gm.dvalue, gx.dvalue, 5 * tol, delta * double(L) * dmax, "dvalue");
  });
  cpu::force_isa(std::nullopt);
  return 0;
}
