// Position kinds by name, the sinusoidal table (formula in positional.h,
// computed in double) and the position ids of a learned table.
#include "mha/nn/positional.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "nn/layer_util.h"

namespace mha::nn {

namespace {
constexpr const char* kPositionNames[] = {"sinusoidal", "learned", "relative", "rope", "alibi"};
}  // namespace

Position parse_position(const std::string& name) {
  for (size_t i = 0; i < std::size(kPositionNames); ++i)
    if (name == kPositionNames[i]) return Position(i);
  raise<ValueError>("mha::nn::parse_position", "name", "sinusoidal, learned, relative, rope or alibi", "'" + name + "'");
}

std::string to_string(Position position) { return kPositionNames[size_t(position)]; }

namespace {

// Rows [0, rows) of the table for width D in `dtype`, computed once and grown
// by doubling: a training step at 2040 positions of 256 asked libm for half a
// million sines, cosines and powers each time (1.5% of the step's cycles).
// Tables are never written after they are built, so callers share them.
Tensor sinusoidal_table(int64_t rows, int64_t D, DType dtype) {
  static std::mutex mutex;
  static std::map<std::pair<int64_t, DType>, Tensor> tables;
  const std::lock_guard<std::mutex> lock(mutex);
  Tensor& table = tables[{D, dtype}];
  if (table.defined() && table.size(0) >= rows) return table;
  const int64_t n = std::max(rows, table.defined() ? 2 * table.size(0) : int64_t(64));
  std::vector<double> frequency(static_cast<size_t>(D)), values(static_cast<size_t>(n * D));
  for (int64_t e = 0; e < D; ++e) frequency[size_t(e)] = std::pow(10000.0, -double(e - e % 2) / double(D));
  for (int64_t l = 0; l < n; ++l)
    for (int64_t e = 0; e < D; ++e) {
      const double angle = double(l) * frequency[size_t(e)];
      values[size_t(l * D + e)] = e % 2 == 0 ? std::sin(angle) : std::cos(angle);
    }
  table = Tensor::from_values(values, {n, D}, dtype);
  return table;
}

void check_table_rows(const char* fn, int64_t L, int64_t D, int64_t offset) {
  if (L <= 0) raise<ValueError>(fn, "L", "> 0", std::to_string(L));
  if (D <= 0) raise<ValueError>(fn, "D", "> 0", std::to_string(D));
  if (offset < 0) raise<ValueError>(fn, "offset", ">= 0", std::to_string(offset));
}

}  // namespace

Tensor sinusoidal_encoding(int64_t L, int64_t D, DType dtype, int64_t offset) {
  const char* fn = "mha::nn::sinusoidal_encoding";
  check_table_rows(fn, L, D, offset);
  check_layer_dtype(dtype, fn);
  return sinusoidal_table(offset + L, D, dtype).slice(0, offset, offset + L).clone();
}

Tensor add_sinusoidal_encoding(const Tensor& x_in, bool batch_first, int64_t offset) {
  const char* fn = "mha::nn::add_sinusoidal_encoding";
  check_defined(x_in, fn, "x");
  check_layer_dtype(x_in.dtype(), fn);
  if (x_in.dim() != 2 && x_in.dim() != 3)
    raise<ShapeError>(fn, "x", "(L, N, D), (N, L, D) with batch_first, or (L, D)", shape_string(x_in.shape()));
  const Tensor x = x_in.contiguous();
  const int64_t D = x.size(-1), L = x.dim() == 3 && batch_first ? x.size(1) : x.size(0);
  const int64_t N = x.dim() == 3 ? (batch_first ? x.size(0) : x.size(1)) : 1;
  check_table_rows(fn, L, D, offset);
  // The shared table itself (read only, no copy); rows on both threads.
  const Tensor pe = sinusoidal_table(offset + L, D, x.dtype());
  Tensor out = Tensor::empty(x.shape(), x.dtype());
  dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T *src = x.data<T>(), *p = pe.data<T>() + offset * D;
    T* dst = out.data<T>();
#pragma omp parallel for schedule(static) if (N * L * D >= (int64_t(1) << 16))
    for (int64_t nl = 0; nl < N * L; ++nl) {
      const int64_t n = nl / L, l = nl % L, row = batch_first ? n * L + l : l * N + n;
      for (int64_t e = 0; e < D; ++e) dst[row * D + e] = src[row * D + e] + p[l * D + e];
    }
  });
  return out;
}

Tensor position_ids(int64_t N, int64_t L, int64_t offset) {
  const char* fn = "mha::nn::position_ids";
  if (N <= 0) raise<ValueError>(fn, "N", "> 0", std::to_string(N));
  if (L <= 0) raise<ValueError>(fn, "L", "> 0", std::to_string(L));
  if (offset < 0) raise<ValueError>(fn, "offset", ">= 0", std::to_string(offset));
  Tensor ids = Tensor::empty({N, L}, DType::int64);
  int64_t* id = ids.data<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t l = 0; l < L; ++l) id[n * L + l] = offset + l;
  return ids;
}

}  // namespace mha::nn
