// Boundary checks and small helpers shared by the efficient-attention variants
// (include/mha/variants/): every variant takes (…, L, E) tensors of one float
// dtype, checks them here, then hands contiguous rows to its kernel.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "check.h"
#include "mha/tensor.h"

namespace mha::variants {

Shape leading(const Shape& shape, size_t trailing);
Shape with_tail(Shape shape, std::initializer_list<int64_t> tail);

// t is a defined CPU tensor, float32 or float64, with at least `min_rank`
// dims and none of them empty. `dims` names the expected shape, "(…, L, E)".
void check_operand(const Tensor& t, const std::string& fn, const std::string& name, const std::string& dims,
                   int64_t min_rank = 2);

// t (already checked by check_operand) has the dtype of `first`, named `first_name`.
void check_same_dtype(const Tensor& t, const Tensor& first, const std::string& fn, const std::string& name,
                      const std::string& first_name);

// t's dims before its last `trailing` equal those of `first` (no broadcasting).
void check_same_leading(const Tensor& t, const Tensor& first, size_t trailing, const std::string& fn,
                        const std::string& name, const std::string& first_name);

// t.size(d) == want; `what` says which size it must match, "S = 7 (key's)".
void check_size(const Tensor& t, int64_t d, int64_t want, const std::string& fn, const std::string& name,
                const std::string& what);

// t is defined, has exactly `shape` and `dtype`.
void check_tensor_as(const Tensor& t, const Shape& shape, DType dtype, const std::string& fn,
                     const std::string& name);

// The softmax scale: 1/sqrt(E) by default; a given one must be finite.
double resolve_scale(const std::optional<double>& scale, int64_t E, const std::string& fn);

// Checks that a count-like option is at least `minimum`.
void check_at_least(int64_t value, int64_t minimum, const std::string& fn, const std::string& name);

// Calls f(float{}) or f(double{}) for a checked variant dtype.
template <class F>
decltype(auto) dispatch_real(DType t, F&& f) {
  if (t == DType::float64) return f(double{});
  return f(float{});
}

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, double>) return DType::float64;
  else if constexpr (std::is_same_v<T, int64_t>) return DType::int64;
  else if constexpr (std::is_same_v<T, bool>) return DType::boolean;
  else return DType::float32;
}

// Kernel scratch of n elements of T (uninitialised, or filled with `value`),
// held in a Tensor: the CPU allocator keeps blocks of 1 MiB and more for the
// next call, where a std::vector would map fresh pages every time, and a
// fresh page costs a fault (2-20 µs on the development VM), more than the
// work done on it.
template <class T>
class Buffer {
 public:
  explicit Buffer(int64_t n)
      : holder_(Tensor::empty({n > 0 ? n : 1}, dtype_of<T>())), data_(holder_.data<T>()), size_(n) {}
  Buffer(int64_t n, T value) : Buffer(n) { std::fill(data_, data_ + n, value); }

  T* data() { return data_; }
  const T* data() const { return data_; }
  T& operator[](int64_t i) { return data_[i]; }
  const T& operator[](int64_t i) const { return data_[i]; }
  int64_t size() const { return size_; }

 private:
  Tensor holder_;
  T* data_;
  int64_t size_;
};

// Sizes of a checked (query, key, value) triple.
struct QkvSizes {
  int64_t batch = 1, L = 0, S = 0, E = 0, Ev = 0;
};

// query (…, L, E), key (…, S, E), value (…, S, Ev): checked operands of one
// dtype with the same leading dims, E and S matching.
QkvSizes check_qkv(const Tensor& query, const Tensor& key, const Tensor& value, const std::string& fn);

// Checks dout and the saved tensors of a forward call: each has `shape` (or, for
// the second list, `row_shape`) and the query's dtype.
void check_saved(const Tensor& dout, const Shape& shape, std::initializer_list<std::pair<const Tensor*, const char*>> full,
                 const Shape& row_shape, std::initializer_list<std::pair<const Tensor*, const char*>> rows, DType dtype,
                 const std::string& fn);

// Adds src (any strides, the shape of dst) into dst (contiguous, same dtype).
void add_into(Tensor& dst, const Tensor& src);

// Σ x_e y_e in order (the plain loops of the exact paths).
template <class T>
T dot(const T* x, const T* y, int64_t n) {
  T s = 0;
  for (int64_t e = 0; e < n; ++e) s += x[e] * y[e];
  return s;
}

}  // namespace mha::variants
