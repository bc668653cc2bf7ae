// Boundary checks shared by the efficient-attention variants.
#include "variants/common.h"

#include <cmath>

#include "strided.h"

namespace mha::variants {

Shape leading(const Shape& shape, size_t trailing) { return Shape(shape.begin(), shape.end() - long(trailing)); }

Shape with_tail(Shape shape, std::initializer_list<int64_t> tail) {
  shape.insert(shape.end(), tail);
  return shape;
}

void check_operand(const Tensor& t, const std::string& fn, const std::string& name, const std::string& dims,
                   int64_t min_rank) {
  check_defined(t, fn, name);
  if (t.device() != Device::cpu) raise<DeviceError>(fn, name, "a CPU tensor", to_string(t.device()));
  if (t.dtype() != DType::float32 && t.dtype() != DType::float64)
    raise<DtypeError>(fn, name, "float32 or float64", to_string(t.dtype()));
  if (t.dim() < min_rank)
    raise<ShapeError>(fn, name, "at least " + std::to_string(min_rank) + " dims " + dims, shape_string(t.shape()));
  for (int64_t n : t.shape())
    if (n == 0) raise<ShapeError>(fn, name, "non-empty dims " + dims, shape_string(t.shape()));
}

void check_same_dtype(const Tensor& t, const Tensor& first, const std::string& fn, const std::string& name,
                      const std::string& first_name) {
  if (t.dtype() != first.dtype())
    raise<DtypeError>(fn, name, first_name + "'s dtype " + to_string(first.dtype()), to_string(t.dtype()));
}

void check_same_leading(const Tensor& t, const Tensor& first, size_t trailing, const std::string& fn,
                        const std::string& name, const std::string& first_name) {
  const Shape a = leading(t.shape(), trailing), b = leading(first.shape(), trailing);
  if (a != b)
    raise<ShapeError>(fn, name, "the leading dims " + shape_string(b) + " of " + first_name + " " +
                                    shape_string(first.shape()),
                      shape_string(t.shape()));
}

void check_size(const Tensor& t, int64_t d, int64_t want, const std::string& fn, const std::string& name,
                const std::string& what) {
  if (t.size(d) != want) raise<ShapeError>(fn, name, "dim " + std::to_string(d) + " " + what, shape_string(t.shape()));
}

void check_tensor_as(const Tensor& t, const Shape& shape, DType dtype, const std::string& fn, const std::string& name) {
  check_defined(t, fn, name);
  if (t.shape() != shape) raise<ShapeError>(fn, name, "shape " + shape_string(shape), shape_string(t.shape()));
  if (t.dtype() != dtype) raise<DtypeError>(fn, name, to_string(dtype), to_string(t.dtype()));
  if (t.device() != Device::cpu) raise<DeviceError>(fn, name, "a CPU tensor", to_string(t.device()));
}

double resolve_scale(const std::optional<double>& scale, int64_t E, const std::string& fn) {
  if (scale && !std::isfinite(*scale)) raise<ValueError>(fn, "scale", "a finite number", std::to_string(*scale));
  return scale ? *scale : 1.0 / std::sqrt(double(E));
}

void check_at_least(int64_t value, int64_t minimum, const std::string& fn, const std::string& name) {
  if (value < minimum) raise<ValueError>(fn, name, ">= " + std::to_string(minimum), std::to_string(value));
}

QkvSizes check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, const std::string& fn) {
  check_operand(q, fn, "query", "(…, L, E)");
  check_operand(k, fn, "key", "(…, S, E)");
  check_operand(v, fn, "value", "(…, S, Ev)");
  check_same_dtype(k, q, fn, "key", "query");
  check_same_dtype(v, q, fn, "value", "query");
  check_same_leading(k, q, 2, fn, "key", "query");
  check_same_leading(v, q, 2, fn, "value", "query");
  check_size(k, -1, q.size(-1), fn, "key", "E = " + std::to_string(q.size(-1)) + " (query's)");
  check_size(v, -2, k.size(-2), fn, "value", "S = " + std::to_string(k.size(-2)) + " (key's)");
  return {shape_numel(leading(q.shape(), 2)), q.size(-2), k.size(-2), q.size(-1), v.size(-1)};
}

void check_saved(const Tensor& dout, const Shape& shape, std::initializer_list<std::pair<const Tensor*, const char*>> full,
                 const Shape& row_shape, std::initializer_list<std::pair<const Tensor*, const char*>> rows, DType dtype,
                 const std::string& fn) {
  check_tensor_as(dout, shape, dtype, fn, "dout");
  for (auto [t, name] : full) check_tensor_as(*t, shape, dtype, fn, name);
  for (auto [t, name] : rows) check_tensor_as(*t, row_shape, dtype, fn, name);
}

void add_into(Tensor& dst, const Tensor& src) {
  dispatch_real(dst.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* d = dst.data<T>();
    const T* s = src.data<T>();
    for_each_offset2(dst.shape(), dst.strides(), src.strides(), [&](int64_t a, int64_t b) { d[a] += s[b]; });
  });
}

}  // namespace mha::variants
