// scaled dot-product attention: validation at the boundary, then dispatch.
// Everything below this file sees a checked AttentionParams.
#include "mha/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "attention_params.h"
#include "backend.h"
#include "check.h"
#include "dtype_dispatch.h"

namespace mha {

// The offset is carried from entry to entry as the output index counts up:
// in each dim the source index i / g (g = N / n) steps by one stride each
// time the count within its group reaches g, and goes back to 0 when the
// output index does. Two divisions per dim and entry, which decoding's small
// models paid on every attention call (3.5% of a step at small), become one
// per dim.
std::vector<int64_t> batch_offsets(const Shape& batch_shape, const Shape& shape, const Shape& strides) {
  const size_t nb = batch_shape.size(), lead = nb - shape.size();
  std::vector<int64_t> offsets(size_t(shape_numel(batch_shape)), 0);
  if (offsets.empty()) return offsets;
  // Dims before `lead` are not the source's: one group as wide as the dim, stride 0.
  // back[d]: from the last source index to 0, (shape - 1) strides.
  std::vector<int64_t> group(batch_shape.begin(), batch_shape.end()), stride(nb, 0), back(nb, 0), index(nb, 0),
      within(nb, 0);
  for (size_t d = lead; d < nb; ++d)
    group[d] = batch_shape[d] / shape[d - lead], stride[d] = strides[d - lead],
    back[d] = (shape[d - lead] - 1) * stride[d];
  int64_t o = 0;
  for (size_t b = 0; b < offsets.size(); ++b) {
    offsets[b] = o;
    for (size_t d = nb; d-- > 0;) {
      if (++index[d] < batch_shape[d]) {
        if (++within[d] == group[d]) within[d] = 0, o += stride[d];
        break;
      }
      index[d] = 0, within[d] = 0, o -= back[d];
    }
  }
  return offsets;
}

namespace {

Shape leading(const Shape& s, size_t trailing) { return Shape(s.begin(), s.end() - long(trailing)); }

// Broadcasts the leading dims of query, key and value (see attention.h).
Shape broadcast_batch(const Tensor& q, const Tensor& k, const Tensor& v, const std::string& fn) {
  const Shape qs = leading(q.shape(), 2), ks = leading(k.shape(), 2), vs = leading(v.shape(), 2);
  const size_t nb = std::max({qs.size(), ks.size(), vs.size()});
  auto at = [nb](const Shape& s, size_t d) { return d + s.size() >= nb ? s[d + s.size() - nb] : int64_t(1); };
  Shape out(nb);
  for (size_t d = 0; d < nb; ++d) {
    const int64_t qn = at(qs, d), kn = at(ks, d), vn = at(vs, d);
    const std::string dim_name = "dim " + std::to_string(int64_t(d) - int64_t(nb) - 2);
    if (kn != vn && kn != 1 && vn != 1)
      raise<ShapeError>(fn, "value", "leading dims that broadcast with key's " + shape_string(k.shape()),
                        shape_string(v.shape()) + " (" + dim_name + ": " + std::to_string(vn) +
                            " vs " + std::to_string(kn) + ")");
    const int64_t kv = std::max(kn, vn);
    if (qn == kv || qn == 1 || kv == 1) {
      out[d] = std::max(qn, kv);
    } else if (d + 1 == nb) {  // the heads dim: grouped-query attention
      if (qn % kv != 0)
        throw ShapeError("[" + fn + "] key has " + std::to_string(kv) + " heads; query has " +
                         std::to_string(qn) + ", which " + std::to_string(kv) + " does not divide");
      out[d] = qn;
    } else {
      raise<ShapeError>(fn, "key", "leading dims that broadcast with query's " + shape_string(q.shape()),
                        shape_string(k.shape()) + " (" + dim_name + ": " + std::to_string(kn) +
                            " vs " + std::to_string(qn) + ")");
    }
  }
  return out;
}

// The user's mask as an additive mask in the compute dtype (bool: 0 / -inf).
template <class A>
Tensor additive_mask(const Tensor& mask, const std::string& fn) {
  Tensor out = Tensor::empty(mask.shape(), std::is_same_v<A, double> ? DType::float64 : DType::float32);
  A* dst = out.data<A>();
  std::vector<double> values = mask.to_vector();
  const bool from_bool = mask.dtype() == DType::boolean;
  for (size_t i = 0; i < values.size(); ++i) {
    const double x = values[i];
    if (from_bool) {
      dst[i] = x != 0.0 ? A(0) : -INFINITY;
    } else {
      if (std::isnan(x) || x == INFINITY)
        raise<ValueError>(fn, "mask", "finite values or -inf", (std::isnan(x) ? "NaN" : "+inf") +
                                                                   std::string(" at flat index ") +
                                                                   std::to_string(i));
      dst[i] = A(x);
    }
  }
  return out;
}

AttentionParams make_params(const Tensor& q, const Tensor& k, const Tensor& v,
                            const AttentionOptions& o, const std::string& fn) {
  check_defined(q, fn, "query");
  check_defined(k, fn, "key");
  check_defined(v, fn, "value");
  for (const Tensor* t : {&k, &v, &o.mask})
    if (t->defined() && t->device() != q.device())
      raise<DeviceError>(fn, t == &k ? "key" : t == &v ? "value" : "mask",
                         "the query's device " + to_string(q.device()), to_string(t->device()));
  backend_for(q.device(), fn.c_str());
  if (!is_floating(q.dtype()))
    raise<DtypeError>(fn, "query", "float32, float64 or bfloat16", to_string(q.dtype()));
  if (k.dtype() != q.dtype()) raise<DtypeError>(fn, "key", "query's dtype " + to_string(q.dtype()), to_string(k.dtype()));
  if (v.dtype() != q.dtype()) raise<DtypeError>(fn, "value", "query's dtype " + to_string(q.dtype()), to_string(v.dtype()));
  for (auto [t, name, dims] : {std::tuple{&q, "query", "(…, L, E)"}, {&k, "key", "(…, S, E)"}, {&v, "value", "(…, S, Ev)"}}) {
    if (t->dim() < 2) raise<ShapeError>(fn, name, std::string("at least 2 dims ") + dims, shape_string(t->shape()));
    for (int64_t n : t->shape())
      if (n == 0) raise<ShapeError>(fn, name, "non-empty dims", shape_string(t->shape()));
  }
  if (k.size(-1) != q.size(-1))
    raise<ShapeError>(fn, "key", "last dim E = " + std::to_string(q.size(-1)) + " (query's)",
                      shape_string(k.shape()));
  if (v.size(-2) != k.size(-2))
    raise<ShapeError>(fn, "value", "dim -2 S = " + std::to_string(k.size(-2)) + " (key's)",
                      shape_string(v.shape()));

  AttentionParams p;
  p.dtype = q.dtype();
  p.compute = q.dtype() == DType::float64 ? DType::float64 : DType::float32;
  p.batch_shape = broadcast_batch(q, k, v, fn);
  p.batch = shape_numel(p.batch_shape);
  p.L = q.size(-2), p.S = k.size(-2), p.E = q.size(-1), p.Ev = v.size(-1);
  p.q = q, p.k = k, p.v = v;
  p.q_offset = batch_offsets(p.batch_shape, leading(q.shape(), 2), leading(q.strides(), 2));
  p.k_offset = batch_offsets(p.batch_shape, leading(k.shape(), 2), leading(k.strides(), 2));
  p.v_offset = batch_offsets(p.batch_shape, leading(v.shape(), 2), leading(v.strides(), 2));
  p.q_row = q.stride(-2), p.q_col = q.stride(-1);
  p.k_row = k.stride(-2), p.k_col = k.stride(-1);
  p.v_row = v.stride(-2), p.v_col = v.stride(-1);

  if (o.mask.defined()) {
    Shape full = p.batch_shape;
    full.push_back(p.L);
    full.push_back(p.S);
    bool fits = o.mask.dim() <= int64_t(full.size());
    for (int64_t d = 1; fits && d <= o.mask.dim(); ++d) {
      const int64_t m = o.mask.size(-d), want = full[full.size() - size_t(d)];
      fits = m == want || m == 1;
    }
    if (!fits)
      raise<ShapeError>(fn, "mask", "a shape that broadcasts to (…, L, S) = " + shape_string(full),
                        shape_string(o.mask.shape()));
    if (o.mask.dtype() != DType::boolean && !is_floating(o.mask.dtype()))
      raise<DtypeError>(fn, "mask", "bool or a floating dtype", to_string(o.mask.dtype()));
    p.mask_from_bool = o.mask.dtype() == DType::boolean;
    p.mask = p.compute == DType::float64 ? additive_mask<double>(o.mask, fn) : additive_mask<float>(o.mask, fn);
    Tensor expanded = p.mask.expand(full);
    p.mask_offset = batch_offsets(p.batch_shape, p.batch_shape, leading(expanded.strides(), 2));
    p.mask_row = expanded.stride(-2), p.mask_col = expanded.stride(-1);
  }

  if (o.scale && !std::isfinite(*o.scale))
    raise<ValueError>(fn, "scale", "a finite number", std::to_string(*o.scale));
  // float32 and bfloat16 compute in float32: a scale beyond its range would be infinite there.
  if (o.scale && p.compute == DType::float32 && !(std::abs(*o.scale) <= double(std::numeric_limits<float>::max())))
    raise<ValueError>(fn, "scale", "a number finite in float32 (the compute dtype of " + to_string(p.dtype) + " inputs)",
                      std::to_string(*o.scale));
  p.scale = o.scale ? *o.scale : 1.0 / std::sqrt(double(p.E));
  if (!(o.dropout_p >= 0.0 && o.dropout_p < 1.0))
    raise<ValueError>(fn, "dropout_p", "a probability in [0, 1)", std::to_string(o.dropout_p));
  p.dropout_p = o.dropout_p;
  p.dropout_seed = o.dropout_seed;
  p.causal = o.causal;
  if (o.window_left < -1) raise<ValueError>(fn, "window_left", ">= 0, or -1 for unbounded", std::to_string(o.window_left));
  if (o.window_right < -1) raise<ValueError>(fn, "window_right", ">= 0, or -1 for unbounded", std::to_string(o.window_right));
  // One band for causal and window: i + lo_shift <= j < i + hi_shift.
  const int64_t unbounded = int64_t(1) << 40, diagonal = p.S - p.L;
  p.lo_shift = o.window_left >= 0 ? diagonal - o.window_left : -unbounded;
  p.hi_shift = o.window_right >= 0 ? diagonal + o.window_right + 1 : unbounded;
  if (o.causal == Causal::top_left) p.hi_shift = std::min<int64_t>(p.hi_shift, 1);
  if (o.causal == Causal::bottom_right) p.hi_shift = std::min<int64_t>(p.hi_shift, diagonal + 1);
  p.return_weights = o.return_weights;
  if (o.keep_scores_bytes < 0)
    raise<ValueError>(fn, "keep_scores_bytes", ">= 0 (0: keep no scores)", std::to_string(o.keep_scores_bytes));
  p.keep_scores_bytes = o.keep_scores_bytes;
  return p;
}

// The documented rule: fused for float32 and bfloat16 unless a mask gradient
// is wanted; reference otherwise. A forced path must be able to run.
AttentionPath choose_path(const AttentionParams& p, AttentionPath requested, bool mask_grad, const std::string& fn) {
  const bool fused_ok = p.dtype != DType::float64 && !mask_grad;
  if (requested == AttentionPath::fused && !fused_ok)
    raise<ValueError>(fn, "path", "float32 or bfloat16 inputs and no mask gradient for the fused path",
                      mask_grad ? std::string("mask_grad = true") : to_string(p.dtype) + " inputs");
  if (requested == AttentionPath::automatic) return fused_ok ? AttentionPath::fused : AttentionPath::reference;
  return requested;
}

Shape with_tail(Shape s, std::initializer_list<int64_t> tail) {
  s.insert(s.end(), tail);
  return s;
}

}  // namespace

std::string to_string(AttentionPath path) {
  switch (path) {
    case AttentionPath::automatic: return "automatic";
    case AttentionPath::reference: return "reference";
    case AttentionPath::fused: return "fused";
  }
  return "?";
}

namespace {

// An output the caller gives: shaped, typed and placed as expected, unit last stride.
void check_output(const Tensor& t, const Shape& shape, DType dtype, const Tensor& query, const std::string& fn,
                  const char* name) {
  check_defined(t, fn, name);
  if (t.shape() != shape) raise<ShapeError>(fn, name, "shape " + shape_string(shape), shape_string(t.shape()));
  if (t.dtype() != dtype) raise<DtypeError>(fn, name, to_string(dtype), to_string(t.dtype()));
  if (t.device() != query.device())
    raise<DeviceError>(fn, name, "the query's device " + to_string(query.device()), to_string(t.device()));
  if (shape.back() > 1 && t.stride(-1) != 1)
    raise<ValueError>(fn, name, "unit stride along the last dim", "stride " + std::to_string(t.stride(-1)));
}

AttentionOutput forward_to(const Tensor* out, const Tensor& query, const Tensor& key, const Tensor& value,
                           const AttentionOptions& options, const std::string& fn) {
  AttentionParams p = make_params(query, key, value, options, fn);
  p.path = choose_path(p, options.path, false, fn);
  const Shape out_shape = with_tail(p.batch_shape, {p.L, p.Ev});
  if (out) check_output(*out, out_shape, p.dtype, query, fn, "out");
  AttentionOutput r;
  r.out = out ? *out : Tensor::empty(out_shape, p.dtype, query.device());
  r.lse = Tensor::empty(with_tail(p.batch_shape, {p.L}), p.compute, query.device());
  if (p.return_weights) r.weights = Tensor::empty(with_tail(p.batch_shape, {p.L, p.S}), p.dtype, query.device());
  r.path = p.path;
  backend_for(query.device(), fn.c_str()).attention_forward(p, r);
  return r;
}

void backward_to(AttentionGradients& g, bool given, const Tensor& dout, const Tensor& query, const Tensor& key,
                 const Tensor& value, const AttentionOutput& forward, const AttentionOptions& options, bool mask_grad,
                 const Tensor& dweights, const std::string& fn) {
  AttentionParams p = make_params(query, key, value, options, fn);
  const Shape out_shape = with_tail(p.batch_shape, {p.L, p.Ev});
  const Shape lse_shape = with_tail(p.batch_shape, {p.L});
  check_defined(dout, fn, "dout");
  check_defined(forward.out, fn, "forward.out");
  check_defined(forward.lse, fn, "forward.lse");
  if (dout.shape() != out_shape) raise<ShapeError>(fn, "dout", "shape " + shape_string(out_shape), shape_string(dout.shape()));
  if (dout.dtype() != p.dtype) raise<DtypeError>(fn, "dout", to_string(p.dtype), to_string(dout.dtype()));
  if (forward.out.shape() != out_shape)
    raise<ShapeError>(fn, "forward.out", "shape " + shape_string(out_shape), shape_string(forward.out.shape()));
  if (forward.out.dtype() != p.dtype) raise<DtypeError>(fn, "forward.out", to_string(p.dtype), to_string(forward.out.dtype()));
  if (forward.lse.shape() != lse_shape)
    raise<ShapeError>(fn, "forward.lse", "shape " + shape_string(lse_shape), shape_string(forward.lse.shape()));
  if (forward.lse.dtype() != p.compute)
    raise<DtypeError>(fn, "forward.lse", to_string(p.compute), to_string(forward.lse.dtype()));
  for (const Tensor* t : {&dout, &forward.out, &forward.lse})
    if (t->device() != query.device())
      raise<DeviceError>(fn, t == &dout ? "dout" : "forward", "the query's device " + to_string(query.device()),
                         to_string(t->device()));
  if (mask_grad && (!options.mask.defined() || p.mask_from_bool))
    raise<ValueError>(fn, "mask_grad", "a floating (additive) mask in options.mask",
                      options.mask.defined() ? "a bool mask" : "no mask");
  if (dweights.defined()) {
    const Shape weights_shape = with_tail(p.batch_shape, {p.L, p.S});
    if (dweights.shape() != weights_shape)
      raise<ShapeError>(fn, "dweights", "shape " + shape_string(weights_shape), shape_string(dweights.shape()));
    if (dweights.dtype() != p.dtype) raise<DtypeError>(fn, "dweights", to_string(p.dtype), to_string(dweights.dtype()));
    if (dweights.device() != query.device())
      raise<DeviceError>(fn, "dweights", "the query's device " + to_string(query.device()), to_string(dweights.device()));
    p.dweights = dweights.contiguous();
  }
  p.path = choose_path(p, options.path, mask_grad, fn);
  if (given) {
    check_output(g.dquery, query.shape(), p.dtype, query, fn, "into.dquery");
    check_output(g.dkey, key.shape(), p.dtype, query, fn, "into.dkey");
    check_output(g.dvalue, value.shape(), p.dtype, query, fn, "into.dvalue");
  } else {
    g.dquery = Tensor::empty(query.shape(), p.dtype, query.device());
    g.dkey = Tensor::empty(key.shape(), p.dtype, query.device());
    g.dvalue = Tensor::empty(value.shape(), p.dtype, query.device());
  }
  g.dmask = mask_grad ? Tensor::empty(options.mask.shape(), options.mask.dtype(), query.device()) : Tensor{};
  backend_for(query.device(), fn.c_str()).attention_backward(p, dout, forward, g);
}

}  // namespace

AttentionOutput attention_forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                  const AttentionOptions& options) {
  return forward_to(nullptr, query, key, value, options, "mha::attention_forward");
}

AttentionOutput attention_forward_into(const Tensor& out, const Tensor& query, const Tensor& key, const Tensor& value,
                                       const AttentionOptions& options) {
  return forward_to(&out, query, key, value, options, "mha::attention_forward_into");
}

AttentionGradients attention_backward(const Tensor& dout, const Tensor& query, const Tensor& key,
                                      const Tensor& value, const AttentionOutput& forward,
                                      const AttentionOptions& options, bool mask_grad, const Tensor& dweights) {
  AttentionGradients g;
  backward_to(g, false, dout, query, key, value, forward, options, mask_grad, dweights, "mha::attention_backward");
  return g;
}

void attention_backward_into(AttentionGradients& into, const Tensor& dout, const Tensor& query, const Tensor& key,
                             const Tensor& value, const AttentionOutput& forward, const AttentionOptions& options,
                             bool mask_grad, const Tensor& dweights) {
  backward_to(into, true, dout, query, key, value, forward, options, mask_grad, dweights,
              "mha::attention_backward_into");
}

}  // namespace mha
