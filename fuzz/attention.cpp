// Fuzzes the attention API: shapes, strides, masks and options decoded from
// the input, values drawn from a seed in it with a few NaN, ±inf or huge
// entries planted. Invalid combinations must be refused with a typed error;
// valid ones must give, on the fused path (on an instruction set the input
// picks), what the reference path gives: NaN where it has NaN, the same
// values elsewhere, forward and backward.
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
    t.set_item(at, values[in.ConsumeIntegralInRange(0, 5)]);
  }
  return t;
}

void compare(const Tensor& fused, const Tensor& reference, double tol, const char* what) {
  const std::vector<double> a = fused.to_vector(), b = reference.to_vector();
  double scale = 1;
  for (double y : b)
    if (std::isfinite(y)) scale = std::max(scale, std::abs(y));
  for (size_t i = 0; i < a.size(); ++i) {
    const bool same = std::isnan(b[i]) ? std::isnan(a[i])
                      : std::isinf(b[i]) ? a[i] == b[i]
                                         : std::isfinite(a[i]) && std::abs(a[i] - b[i]) <= tol * scale;
    if (!same)
      fuzz::finding(std::string(what) + "[" + std::to_string(i) + "]: fused " + std::to_string(a[i]) + ", reference " +
                    std::to_string(b[i]));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
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
  fuzz::refusals_allowed([&] {
    AttentionOptions fused = o, reference = o;
    fused.path = AttentionPath::fused, reference.path = AttentionPath::reference;
    const AttentionOutput a = attention_forward(q, k, v, fused), b = attention_forward(q, k, v, reference);
    const double tol = dtype == DType::bfloat16 ? 2e-2 : 2e-5;
    compare(a.out, b.out, tol, "out");
    compare(a.lse, b.lse, 1e-4, "lse");
    const Tensor dout = randn(b.out.shape(), gen, 0.0, 1.0, dtype);
    const AttentionGradients ga = attention_backward(dout, q, k, v, a, fused), gb = attention_backward(dout, q, k, v, b, reference);
    compare(ga.dquery, gb.dquery, 5 * tol, "dquery");
    compare(ga.dkey, gb.dkey, 5 * tol, "dkey");
    compare(ga.dvalue, gb.dvalue, 5 * tol, "dvalue");
  });
  cpu::force_isa(std::nullopt);
  return 0;
}
