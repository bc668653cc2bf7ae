// Helpers shared by the tests of the efficient-attention variants.
#pragma once

#include <cstdio>
#include <string>

#include "testing.h"

namespace mha::testing {

// ||a - b|| / ||b|| over all elements: an approximation's error against the exact result.
inline double relative_error(const Tensor& a, const Tensor& b) {
  std::vector<double> x = a.to_vector(), y = b.to_vector();
  double d = 0, n = 0;
  for (size_t i = 0; i < x.size(); ++i) d += (x[i] - y[i]) * (x[i] - y[i]), n += y[i] * y[i];
  return std::sqrt(d / n);
}

struct GradientOf {
  const char* name;
  Tensor input;     // float64; moved by ±h in place
  Tensor analytic;  // its gradient as the backward returned it
};

// Relative error of each analytic gradient of Σ forward()∘r against central
// differences; each must stay below 1e-6. forward() reads the inputs' current values.
template <class Forward>
void expect_gradients(const std::string& name, const Tensor& r, Forward&& forward, std::initializer_list<GradientOf> inputs) {
  auto loss = [&] { return weighted_sum(forward(), r); };
  std::printf("  %-40s relative error", name.c_str());
  for (const GradientOf& g : inputs) {
    const double e = gradient_error(g.input, g.analytic, loss);
    EXPECT_LT(e, 1e-6) << name << " " << g.name;
    std::printf(" %s %.1e", g.name, e);
  }
  std::printf("\n");
}

}  // namespace mha::testing
