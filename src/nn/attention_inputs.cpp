// Masks, bias and returned weights between a MultiheadAttention and its
// attention core (attention_inputs.h).
#include "nn/attention_inputs.h"

#include <cmath>
#include <vector>

#include "check.h"
#include "dtype_dispatch.h"

namespace mha::nn {

Tensor combine_masks(const char* fn, const MultiheadAttentionInputs& in, int64_t N, int64_t H, int64_t L, int64_t S,
                     int64_t S_total, bool batched, DType dtype, bool force_additive) {
  const Tensor& am = in.attn_mask;
  const Tensor& kpm = in.key_padding_mask;
  if (!am.defined() && !kpm.defined()) return {};
  if (am.defined()) {
    const bool ok = (am.dim() == 2 && am.shape() == Shape{L, S}) ||
                    (am.dim() == 3 && am.shape() == Shape{N * H, L, S});
    if (!ok)
      raise<ShapeError>(fn, "attn_mask",
                        "shape " + shape_string({L, S}) + " or " + shape_string({N * H, L, S}),
                        shape_string(am.shape()));
  }
  if (kpm.defined()) {
    const Shape want = batched ? Shape{N, S} : Shape{S};
    if (kpm.shape() != want)
      raise<ShapeError>(fn, "key_padding_mask", "shape " + shape_string(want), shape_string(kpm.shape()));
  }
  const bool per_head = am.defined() && am.dim() == 3;
  const int64_t Nm = (per_head || kpm.defined()) ? N : 1, Hm = per_head ? H : 1, Lm = am.defined() ? L : 1;
  const bool all_bool = !force_additive && (!am.defined() || am.dtype() == DType::boolean) &&
                        (!kpm.defined() || kpm.dtype() == DType::boolean);
  const std::vector<double> a = am.defined() ? am.contiguous().to_vector() : std::vector<double>{};
  const std::vector<double> k = kpm.defined() ? kpm.contiguous().to_vector() : std::vector<double>{};
  const bool a_bool = am.defined() && am.dtype() == DType::boolean;
  const bool k_bool = kpm.defined() && kpm.dtype() == DType::boolean;
  // torch: a true bool entry masks out (-inf); a float entry is added.
  auto additive = [](double x, bool is_bool) { return is_bool ? (x != 0.0 ? -INFINITY : 0.0) : x; };
  Tensor mask = Tensor::empty({Nm, Hm, Lm, S_total}, all_bool ? DType::boolean : dtype);
  std::vector<double> values(size_t(mask.numel()));
  size_t x = 0;
  for (int64_t n = 0; n < Nm; ++n)
    for (int64_t h = 0; h < Hm; ++h)
      for (int64_t l = 0; l < Lm; ++l)
        for (int64_t s = 0; s < S_total; ++s, ++x) {
          double add = 0.0;
          if (s < S) {
            if (am.defined()) add += additive(a[size_t(((per_head ? n * H + h : 0) * L + l) * S + s)], a_bool);
            if (kpm.defined()) add += additive(k[size_t(n * S + s)], k_bool);
          }
          values[x] = all_bool ? (add == 0.0 ? 1.0 : 0.0) : add;
        }
  return Tensor::from_values(values, mask.shape(), mask.dtype());
}

void check_attn_bias(const char* fn, const Tensor& bias, int64_t N, int64_t H, int64_t L, int64_t S, DType dtype) {
  if (bias.dtype() != dtype) raise<DtypeError>(fn, "attn_bias", to_string(dtype) + " (the module's dtype)", to_string(bias.dtype()));
  if (bias.device() != Device::cpu) raise<DeviceError>(fn, "attn_bias", "a cpu tensor", to_string(bias.device()));
  if (bias.dim() != 4 || (bias.size(0) != 1 && bias.size(0) != N) || bias.size(1) != H || bias.size(2) != L ||
      bias.size(3) != S)
    raise<ShapeError>(fn, "attn_bias", "(1 or N, H, L, S) = (1 or " + std::to_string(N) + ", " + std::to_string(H) +
                      ", " + std::to_string(L) + ", " + std::to_string(S) + ")", shape_string(bias.shape()));
}

Tensor add_bias(const Tensor& mask, const Tensor& bias, int64_t S_total) {
  const int64_t N = std::max(mask.defined() ? mask.size(0) : 1, bias.size(0)), H = bias.size(1), L = bias.size(2),
                S = bias.size(3);
  const Shape shape{N, H, L, S_total};
  std::vector<double> sum = mask.defined() ? mask.expand(shape).contiguous().to_vector()
                                           : std::vector<double>(size_t(shape_numel(shape)), 0.0);
  const std::vector<double> b = bias.expand({N, H, L, S}).contiguous().to_vector();
  for (int64_t row = 0; row < N * H * L; ++row)
    for (int64_t s = 0; s < S; ++s) sum[size_t(row * S_total + s)] += b[size_t(row * S + s)];
  return Tensor::from_values(sum, shape, bias.dtype());
}

Tensor bias_gradient(const Tensor& dmask, const Shape& bias_shape) {
  const Tensor d = dmask.slice(3, 0, bias_shape[3]).contiguous();
  if (d.size(0) == bias_shape[0]) return d;
  const int64_t per_entry = shape_numel(bias_shape);
  const std::vector<double> all = d.to_vector();
  std::vector<double> sum(size_t(per_entry), 0.0);
  for (size_t x = 0; x < all.size(); ++x) sum[x % size_t(per_entry)] += all[x];
  return Tensor::from_values(sum, bias_shape, d.dtype());
}

Tensor average_heads(const Tensor& weights, int64_t N, int64_t H, int64_t L, int64_t S) {
  Tensor avg = Tensor::zeros({N, L, S}, DType::float64);
  double* a = avg.data<double>();
  const std::vector<double> all = weights.to_vector();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t x = 0; x < L * S; ++x) a[n * L * S + x] += all[size_t((n * H + h) * L * S + x)] / double(H);
  return avg;
}

Tensor heads_weights_gradient(const Tensor& dweights, bool averaged, int64_t N, int64_t H, int64_t L, int64_t S,
                              DType dtype) {
  const std::vector<double> d = dweights.contiguous().to_vector();
  if (!averaged) return Tensor::from_values(d, {N, H, L, S}, dtype);
  std::vector<double> per_head(size_t(N * H * L * S));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t x = 0; x < L * S; ++x) per_head[size_t((n * H + h) * L * S + x)] = d[size_t(n * L * S + x)] / double(H);
  return Tensor::from_values(per_head, {N, H, L, S}, dtype);
}

void gate_heads(Tensor& heads, const Tensor& gate) {
  const std::vector<double> g = gate.to_vector();
  const int64_t H = int64_t(g.size()), D = heads.size(-1), Dh = D / H, rows = heads.numel() / D;
  dispatch_dtype(heads.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, bool> && !std::is_same_v<T, int64_t>) {
      T* x = heads.data<T>();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t e = 0; e < D; ++e) x[r * D + e] = store_as<T>(load_as<double>(x[r * D + e]) * g[size_t(e / Dh)]);
    }
  });
}

void gate_heads_backward(Tensor& dheads, const Tensor& ungated, const Tensor& gate, Tensor& gate_grad) {
  const std::vector<double> g = gate.to_vector(), u = ungated.to_vector();
  const int64_t H = int64_t(g.size()), D = dheads.size(-1), Dh = D / H, rows = dheads.numel() / D;
  std::vector<double> sum(size_t(H), 0.0);
  dispatch_dtype(dheads.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, bool> && !std::is_same_v<T, int64_t>) {
      T* d = dheads.data<T>();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t e = 0; e < D; ++e) {
          const double de = load_as<double>(d[r * D + e]);
          sum[size_t(e / Dh)] += de * u[size_t(r * D + e)];
          d[r * D + e] = store_as<T>(de * g[size_t(e / Dh)]);
        }
    }
  });
  dispatch_dtype(gate_grad.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, bool> && !std::is_same_v<T, int64_t>) {
      T* out = gate_grad.data<T>();
      for (int64_t h = 0; h < H; ++h) out[h] = store_as<T>(load_as<double>(out[h]) + sum[size_t(h)]);
    }
  });
}

}  // namespace mha::nn
