// Linformer: sequence projections of keys and values (BLAS), then exact
// attention over the k projected rows through attention_forward/backward.
// The derivation is in include/mha/variants/linformer.h.
#include "mha/variants/linformer.h"

#include <cmath>
#include <utility>

#include "cpu/gemm.h"
#include "mha/random.h"
#include "variants/common.h"

namespace mha {

namespace {

using variants::dispatch_real;

struct Call {
  variants::QkvSizes n;
  int64_t rank = 0;  // k
};

Call check_call(const Tensor& q, const Tensor& k, const Tensor& v, const LinformerOptions& o, const std::string& fn) {
  const variants::QkvSizes n = variants::check_qkv(q, k, v, fn);
  for (auto [p, name] : {std::pair{&o.key_projection, "options.key_projection"}, {&o.value_projection, "options.value_projection"}}) {
    variants::check_operand(*p, fn, name, "(k, S)");
    if (p->dim() != 2) raise<ShapeError>(fn, name, "2 dims (k, S)", shape_string(p->shape()));
    variants::check_same_dtype(*p, q, fn, name, "query");
    variants::check_size(*p, -1, n.S, fn, name, "S = " + std::to_string(n.S) + " (key's)");
  }
  if (o.value_projection.size(0) != o.key_projection.size(0))
    raise<ShapeError>(fn, "options.value_projection", "k = " + std::to_string(o.key_projection.size(0)) + " rows (key_projection's)",
                      shape_string(o.value_projection.shape()));
  (void)variants::resolve_scale(o.scale, n.E, fn);
  if (o.path == AttentionPath::fused && q.dtype() == DType::float64)
    raise<ValueError>(fn, "options.path", "float32 inputs for the fused path", "float64 inputs");
  return {n, o.key_projection.size(0)};
}

// Y_b = P X_b for every batch entry: P (k, S), X (batch, S, width) contiguous.
Tensor project(const Tensor& p, const Tensor& x, int64_t batch, int64_t S, int64_t width, Shape shape) {
  const int64_t k = p.size(0);
  shape[shape.size() - 2] = k;
  Tensor y = Tensor::empty(shape, x.dtype());
  dispatch_real(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    for (int64_t b = 0; b < batch; ++b)
      cpu::gemm<T>(false, false, k, width, S, T(1), p.data<T>(), S, x.data<T>() + b * S * width, width, T(0),
                   y.data<T>() + b * k * width, width);
  });
  return y;
}

// dX_b = Pᵀ dY_b into dx, and dP = Σ_b dY_b X_bᵀ.
void project_backward(const Tensor& p, const Tensor& x, const Tensor& dy, int64_t batch, int64_t S, int64_t width,
                      Tensor& dx, Tensor& dp) {
  const int64_t k = p.size(0);
  dispatch_real(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    for (int64_t b = 0; b < batch; ++b) {
      const T* dyb = dy.data<T>() + b * k * width;
      cpu::gemm<T>(true, false, S, width, k, T(1), p.data<T>(), S, dyb, width, T(0), dx.data<T>() + b * S * width, width);
      cpu::gemm<T>(false, true, k, S, width, T(1), dyb, width, x.data<T>() + b * S * width, width, T(b > 0 ? 1 : 0),
                   dp.data<T>(), S);
    }
  });
}

AttentionOptions inner_options(const LinformerOptions& o) { return {.scale = o.scale, .path = o.path}; }

}  // namespace

Tensor linformer_projection(int64_t k, int64_t length, uint64_t seed, DType dtype) {
  const std::string fn = "mha::linformer_projection";
  variants::check_at_least(k, 1, fn, "k");
  variants::check_at_least(length, 1, fn, "length");
  if (dtype != DType::float32 && dtype != DType::float64) raise<DtypeError>(fn, "dtype", "float32 or float64", to_string(dtype));
  Generator gen(seed);
  return randn({k, length}, gen, 0.0, 1.0 / std::sqrt(double(k)), dtype);
}

LinformerOutput linformer_attention_forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                            const LinformerOptions& options) {
  const std::string fn = "mha::linformer_attention_forward";
  const auto [n, rank] = check_call(query, key, value, options, fn);
  LinformerOutput r;
  r.projected_key = project(options.key_projection.contiguous(), key.contiguous(), n.batch, n.S, n.E, key.shape());
  r.projected_value = project(options.value_projection.contiguous(), value.contiguous(), n.batch, n.S, n.Ev, value.shape());
  AttentionOutput a = attention_forward(query, r.projected_key, r.projected_value, inner_options(options));
  r.out = a.out;
  r.lse = a.lse;
  return r;
}

LinformerGradients linformer_attention_backward(const Tensor& dout, const Tensor& query, const Tensor& key,
                                                const Tensor& value, const LinformerOutput& forward,
                                                const LinformerOptions& options) {
  const std::string fn = "mha::linformer_attention_backward";
  const auto [n, rank] = check_call(query, key, value, options, fn);
  Shape kbar = key.shape(), vbar = value.shape();
  kbar[kbar.size() - 2] = vbar[vbar.size() - 2] = rank;
  const Shape lead = variants::leading(query.shape(), 2);
  variants::check_saved(dout, variants::with_tail(lead, {n.L, n.Ev}), {{&forward.out, "forward.out"}},
                        variants::with_tail(lead, {n.L}), {{&forward.lse, "forward.lse"}}, query.dtype(), fn);
  variants::check_tensor_as(forward.projected_key, kbar, query.dtype(), fn, "forward.projected_key");
  variants::check_tensor_as(forward.projected_value, vbar, query.dtype(), fn, "forward.projected_value");
  AttentionGradients a = attention_backward(dout, query, forward.projected_key, forward.projected_value,
                                            {.out = forward.out, .lse = forward.lse}, inner_options(options));
  LinformerGradients g;
  g.dquery = a.dquery;
  g.dkey = Tensor::empty(key.shape(), query.dtype());
  g.dvalue = Tensor::empty(value.shape(), query.dtype());
  g.dkey_projection = Tensor::empty({rank, n.S}, query.dtype());
  g.dvalue_projection = Tensor::empty({rank, n.S}, query.dtype());
  project_backward(options.key_projection.contiguous(), key.contiguous(), a.dkey, n.batch, n.S, n.E, g.dkey, g.dkey_projection);
  project_backward(options.value_projection.contiguous(), value.contiguous(), a.dvalue, n.batch, n.S, n.Ev, g.dvalue,
                   g.dvalue_projection);
  return g;
}

}  // namespace mha
