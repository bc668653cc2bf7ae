// Seeded random numbers from a counter-based generator (Philox-4x32-10).
//
// Element i of a random tensor depends only on (seed, offset + i), never on
// the number of threads that filled it. A Generator is a (seed, offset) pair;
// each call advances the offset past the counters it used.
#pragma once

#include <cstdint>

#include "mha/tensor.h"

namespace mha {

class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed) {}

  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  void set_state(uint64_t seed, uint64_t offset) { seed_ = seed, offset_ = offset; }

  // Reserves n counters and returns the first.
  uint64_t advance(uint64_t n) {
    uint64_t first = offset_;
    offset_ += n;
    return first;
  }
  // A fresh 64-bit value, e.g. a dropout seed.
  uint64_t next_u64();
  // A uniform double in [0, 1): the value rand_uniform({1}, *this, 0, 1,
  // float64) would hold, without a tensor (one counter, as it takes).
  double next_uniform();

 private:
  uint64_t seed_ = 0;
  uint64_t offset_ = 0;
};

// Uniform on [low, high).
Tensor rand_uniform(const Shape& shape, Generator& gen, double low = 0.0, double high = 1.0,
                    DType dtype = DType::float32);
// Normal with the given mean and standard deviation (Box-Muller).
Tensor randn(const Shape& shape, Generator& gen, double mean = 0.0, double stddev = 1.0,
             DType dtype = DType::float32);
// Each element true with probability p.
Tensor rand_bool(const Shape& shape, Generator& gen, double p);

}  // namespace mha
