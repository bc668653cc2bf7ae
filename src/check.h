// Boundary checks: every message reads "[fn] argument: expected ...; got ...".
#pragma once

#include <string>

#include "mha/errors.h"
#include "mha/tensor.h"

namespace mha {

template <class Error>
[[noreturn]] inline void raise(const std::string& fn, const std::string& argument,
                               const std::string& expected, const std::string& got) {
  throw Error("[" + fn + "] " + argument + ": expected " + expected + "; got " + got);
}

inline std::string describe(const Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  return to_string(t.dtype()) + " tensor of shape " + shape_string(t.shape());
}

inline void check_defined(const Tensor& t, const std::string& fn, const std::string& argument) {
  if (!t.defined()) raise<ShapeError>(fn, argument, "a defined tensor", "an undefined one");
}

}  // namespace mha
