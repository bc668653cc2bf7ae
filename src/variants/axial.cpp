// Axial attention: two attention_forward passes on strided views (rows, then
// columns), and their backward in reverse. The derivation is in
// include/mha/variants/axial.h.
#include "mha/variants/axial.h"

#include <utility>

#include "variants/common.h"

namespace mha {

namespace {

// The view that swaps rows and columns.
Tensor columns_of(const Tensor& t) { return t.transpose(-3, -2); }

void check_call(const Tensor& q, const Tensor& k, const Tensor& v, const AxialOptions& o, const std::string& fn) {
  variants::check_operand(q, fn, "query", "(…, rows, cols, E)", 3);
  variants::check_operand(k, fn, "key", "(…, rows, cols, E)", 3);
  variants::check_operand(v, fn, "value", "(…, rows, cols, Ev)", 3);
  variants::check_same_dtype(k, q, fn, "key", "query");
  variants::check_same_dtype(v, q, fn, "value", "query");
  variants::check_same_leading(v, q, 1, fn, "value", "query");
  if (k.shape() != q.shape()) raise<ShapeError>(fn, "key", "query's shape " + shape_string(q.shape()), shape_string(k.shape()));
  (void)variants::resolve_scale(o.scale, q.size(-1), fn);
  if (o.path == AttentionPath::fused && q.dtype() == DType::float64)
    raise<ValueError>(fn, "options.path", "float32 inputs for the fused path", "float64 inputs");
}

AttentionOptions pass_options(const AxialOptions& o) { return {.scale = o.scale, .path = o.path}; }

}  // namespace

AxialOutput axial_attention_forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                    const AxialOptions& options) {
  check_call(query, key, value, options, "mha::axial_attention_forward");
  const AttentionOptions o = pass_options(options);
  AxialOutput r;
  r.row = attention_forward(query, key, value, o);
  r.column = attention_forward(columns_of(query), columns_of(key), columns_of(r.row.out), o);
  r.out = columns_of(r.column.out).contiguous();
  return r;
}

AttentionGradients axial_attention_backward(const Tensor& dout, const Tensor& query, const Tensor& key,
                                            const Tensor& value, const AxialOutput& forward,
                                            const AxialOptions& options) {
  const std::string fn = "mha::axial_attention_backward";
  check_call(query, key, value, options, fn);
  variants::check_saved(dout, value.shape(), {{&forward.row.out, "forward.row.out"}}, variants::leading(value.shape(), 1),
                        {{&forward.row.lse, "forward.row.lse"}}, query.dtype(), fn);
  Shape column_shape = value.shape();  // (…, cols, rows, Ev)
  std::swap(column_shape[column_shape.size() - 3], column_shape[column_shape.size() - 2]);
  variants::check_tensor_as(forward.column.out, column_shape, query.dtype(), fn, "forward.column.out");
  variants::check_tensor_as(forward.column.lse, variants::leading(column_shape, 1), query.dtype(), fn, "forward.column.lse");
  const AttentionOptions o = pass_options(options);
  AttentionGradients column = attention_backward(columns_of(dout), columns_of(query), columns_of(key),
                                                 columns_of(forward.row.out), forward.column, o);
  AttentionGradients g = attention_backward(columns_of(column.dvalue), query, key, value, forward.row, o);
  variants::add_into(g.dquery, columns_of(column.dquery));
  variants::add_into(g.dkey, columns_of(column.dkey));
  return g;
}

}  // namespace mha
