// Shared checks and element-type dispatch for the layers in src/nn/.
#pragma once

#include <string>

#include "check.h"
#include "cpu/layers/layers.h"

namespace mha::nn {

// Calls f(float{}) or f(double{}) for a layer's dtype.
template <class F>
void dispatch_float(DType dtype, F&& f) {
  if (dtype == DType::float64) f(double{});
  else f(float{});
}

inline void check_layer_dtype(DType dtype, const char* fn) {
  if (dtype != DType::float32 && dtype != DType::float64)
    raise<DtypeError>(fn, "dtype", "float32 or float64", to_string(dtype));
}

// x: defined, on the CPU, of `dtype`, at least 1-D, last dim `last` (0 = any).
inline void check_input(const Tensor& x, const char* fn, const char* name, DType dtype, int64_t last) {
  check_defined(x, fn, name);
  if (x.device() != Device::cpu) raise<DeviceError>(fn, name, "a cpu tensor", to_string(x.device()));
  if (x.dtype() != dtype) raise<DtypeError>(fn, name, to_string(dtype) + " (the layer's dtype)", to_string(x.dtype()));
  if (x.dim() < 1) raise<ShapeError>(fn, name, "at least 1 dim", shape_string(x.shape()));
  if (last > 0 && x.size(-1) != last)
    raise<ShapeError>(fn, name, "last dim " + std::to_string(last), shape_string(x.shape()));
}

// backward(dy) needs a forward first and dy shaped like that forward's output.
inline void check_backward(const Tensor& saved, const Tensor& dy, const Shape& want, DType dtype, const char* fn) {
  if (!saved.defined()) throw StateError(std::string("[") + fn + "] state: expected a forward call first; got none");
  check_defined(dy, fn, "dy");
  if (dy.shape() != want) raise<ShapeError>(fn, "dy", "the output's shape " + shape_string(want), shape_string(dy.shape()));
  if (dy.dtype() != dtype) raise<DtypeError>(fn, "dy", to_string(dtype), to_string(dy.dtype()));
}

// db (cols) += Σ_rows dy, dy rows × cols contiguous (a bias's gradient); dy
// may be bfloat16 under a float32 db (a bf16-mixed layer's rounded gradient).
template <class D, class T>
void add_bias_gradient(const D* dy, int64_t rows, int64_t cols, T* db) {
  if constexpr (std::is_same_v<T, float>) {
    cpu::add_column_sums(dy, rows, cols, db);
  } else {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) db[c] += T(dy[r * cols + c]);
  }
}

}  // namespace mha::nn
