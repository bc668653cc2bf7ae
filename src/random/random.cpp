// Random tensors: element i uses Philox block (offset + i) of the generator's
// seed, so the values do not depend on how many threads fill the tensor.
#include "mha/random.h"

#include <cmath>

#include "dtype_dispatch.h"
#include "mha/errors.h"
#include "random/philox.h"

namespace mha {

namespace {

// Uniform in (0, 1] from two 32-bit words (53 random bits).
double unit_open_closed(uint32_t hi, uint32_t lo) {
  uint64_t bits = (uint64_t(hi) << 21) ^ (uint64_t(lo) >> 11);
  return (double(bits & ((uint64_t(1) << 53) - 1)) + 1.0) / 9007199254740992.0;
}

// Uniform in [0, 1) from a block's first two words.
double uniform_of(const PhiloxBlock& b) { return 1.0 - unit_open_closed(b[0], b[1]); }

void check_floating(DType dtype, const char* fn) {
  if (!is_floating(dtype))
    throw DtypeError(std::string("[") + fn + "] dtype: expected a floating dtype; got " + to_string(dtype));
}

template <class Fill>
Tensor fill_random(const Shape& shape, Generator& gen, DType dtype, Fill&& value) {
  Tensor t = Tensor::empty(shape, dtype);
  const int64_t n = t.numel();
  const uint64_t base = gen.advance(uint64_t(n));
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* p = t.data<T>();
    // A region costs a wake-up and a barrier: not for a few values (a task's
    // examples draw one at a time).
#pragma omp parallel for schedule(static) if (n >= 4096)
    for (int64_t i = 0; i < n; ++i) p[i] = from_double<T>(value(philox_block(gen.seed(), 0, base + uint64_t(i))));
  });
  return t;
}

}  // namespace

uint64_t Generator::next_u64() {
  PhiloxBlock b = philox_block(seed_, 1, advance(1));
  return (uint64_t(b[0]) << 32) | b[1];
}

double Generator::next_uniform() {
  return uniform_of(philox_block(seed_, 0, advance(1)));
}

Tensor rand_uniform(const Shape& shape, Generator& gen, double low, double high, DType dtype) {
  const char* fn = "mha::rand_uniform";
  if (!std::isfinite(low) || !std::isfinite(high) || !(low <= high))
    throw ValueError(std::string("[") + fn + "] low, high: expected finite low <= high; got " +
                     std::to_string(low) + ", " + std::to_string(high));
  check_floating(dtype, fn);
  return fill_random(shape, gen, dtype, [&](const PhiloxBlock& b) {
    return low + (high - low) * uniform_of(b);
  });
}

Tensor randn(const Shape& shape, Generator& gen, double mean, double stddev, DType dtype) {
  const char* fn = "mha::randn";
  if (!std::isfinite(mean) || !std::isfinite(stddev) || stddev < 0)
    throw ValueError(std::string("[") + fn + "] mean, stddev: expected finite values, stddev >= 0; got " +
                     std::to_string(mean) + ", " + std::to_string(stddev));
  check_floating(dtype, fn);
  return fill_random(shape, gen, dtype, [&](const PhiloxBlock& b) {
    double r = std::sqrt(-2.0 * std::log(unit_open_closed(b[0], b[1])));
    return mean + stddev * r * std::cos(6.283185307179586 * unit_open_closed(b[2], b[3]));
  });
}

Tensor rand_bool(const Shape& shape, Generator& gen, double p) {
  const char* fn = "mha::rand_bool";
  if (!(p >= 0.0 && p <= 1.0))
    throw ValueError(std::string("[") + fn + "] p: expected in [0, 1]; got " + std::to_string(p));
  return fill_random(shape, gen, DType::boolean, [&](const PhiloxBlock& b) {
    return uniform_of(b) < p ? 1.0 : 0.0;
  });
}

}  // namespace mha
