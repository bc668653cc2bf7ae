// Rotary position embedding (RoFormer, Su et al. 2021), in place on strided
// views: pairs (x_2i, x_2i+1) of row r turn by θ = (offset + r) · base^(−2i/E).
#include <cmath>

#include "mha/nn/positional.h"
#include "nn/layer_util.h"

namespace mha::nn {

void rotate_positions_(Tensor x, int64_t offset, double base, bool inverse) {
  const char* fn = "mha::nn::rotate_positions_";
  check_defined(x, fn, "x");
  check_layer_dtype(x.dtype(), fn);
  if (x.dim() < 2) raise<ShapeError>(fn, "x", "(…, R, E)", shape_string(x.shape()));
  const int64_t R = x.size(-2), E = x.size(-1);
  if (E % 2 != 0) raise<ShapeError>(fn, "x", "an even last dim E (pairs are rotated)", shape_string(x.shape()));
  if (E > 1 && x.stride(-1) != 1) raise<ShapeError>(fn, "x", "a contiguous last dim", "stride " + std::to_string(x.stride(-1)));
  if (offset < 0) raise<ValueError>(fn, "offset", ">= 0", std::to_string(offset));
  if (!(base > 0 && std::isfinite(base))) raise<ValueError>(fn, "base", "finite and > 0", std::to_string(base));
  if (x.numel() == 0) return;
  // cos θ and sin θ for every (row, pair), in double; sin negated for the inverse.
  const int64_t pairs = E / 2;
  std::vector<double> cos_sin(size_t(2 * R * pairs));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < pairs; ++i) {
      const double theta = double(offset + r) * std::pow(base, -2.0 * double(i) / double(E));
      cos_sin[size_t(2 * (r * pairs + i))] = std::cos(theta);
      cos_sin[size_t(2 * (r * pairs + i) + 1)] = inverse ? -std::sin(theta) : std::sin(theta);
    }
  const int64_t lead = x.numel() / (R * E);
  dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* data = x.data<T>();
    for (int64_t flat = 0; flat < lead; ++flat) {
      int64_t at = 0;  // offset of x[flat…, 0, 0]: flat split over the leading dims
      for (int64_t rem = flat, d = x.dim() - 3; d >= 0; --d) {
        at += (rem % x.size(d)) * x.stride(d);
        rem /= x.size(d);
      }
      for (int64_t r = 0; r < R; ++r) {
        T* row = data + at + r * x.stride(-2);
        const double* cs = cos_sin.data() + 2 * r * pairs;
        for (int64_t i = 0; i < pairs; ++i) {
          const T c = T(cs[2 * i]), s = T(cs[2 * i + 1]), a = row[2 * i], b = row[2 * i + 1];
          row[2 * i] = a * c - b * s;
          row[2 * i + 1] = a * s + b * c;
        }
      }
    }
  });
}

}  // namespace mha::nn
