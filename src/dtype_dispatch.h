// Calls a generic lambda with a value of the C++ element type of a DType.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mha/dtype.h"

namespace mha {

template <class F>
decltype(auto) dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::float32: return f(float{});
    case DType::float64: return f(double{});
    case DType::bfloat16: return f(bfloat16{});
    case DType::int64: return f(int64_t{});
    case DType::boolean: break;
  }
  return f(bool{});
}

template <class T>
inline double to_double(T x) {
  if constexpr (std::is_same_v<T, bfloat16>) return double(float(x));
  else return double(x);
}

// Converts to an element type: float via float for bfloat16, != 0 for bool.
template <class T>
inline T from_double(double x) {
  if constexpr (std::is_same_v<T, bfloat16>) return bfloat16(float(x));
  else if constexpr (std::is_same_v<T, bool>) return x != 0.0;
  else return T(x);
}

// Loads an element as the compute type A (float or double).
template <class A, class T>
inline A load_as(const T& x) {
  if constexpr (std::is_same_v<T, bfloat16>) return A(float(x));
  else return A(x);
}

template <class T, class A>
inline T store_as(A x) {
  if constexpr (std::is_same_v<T, bfloat16>) return bfloat16(float(x));
  else return T(x);
}

}  // namespace mha
