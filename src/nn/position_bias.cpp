// Position biases added to the attention logits: T5's relative buckets and
// ALiBi's linear penalties (formulas in positional.h).
#include <cmath>

#include "mha/nn/positional.h"
#include "nn/layer_util.h"

namespace mha::nn {

namespace {

void check_buckets(const char* fn, bool bidirectional, int64_t num_buckets, int64_t max_distance) {
  // Each half (bidirectional) or the whole needs an exact bucket and a log one.
  const int64_t least = bidirectional ? 4 : 2;
  if (num_buckets < least)
    raise<ValueError>(fn, "num_buckets", ">= " + std::to_string(least), std::to_string(num_buckets));
  const int64_t max_exact = (bidirectional ? num_buckets / 2 : num_buckets) / 2;
  if (max_distance <= max_exact)
    raise<ValueError>(fn, "max_distance", "> " + std::to_string(max_exact) + " (the exact buckets)",
                      std::to_string(max_distance));
}

int64_t bucket_unchecked(int64_t relative_position, bool bidirectional, int64_t num_buckets, int64_t max_distance) {
  int64_t bucket = 0, n = 0;
  if (bidirectional) {
    num_buckets /= 2;
    if (relative_position > 0) bucket += num_buckets;
    n = std::abs(relative_position);
  } else {
    n = std::max<int64_t>(-relative_position, 0);
  }
  const int64_t max_exact = num_buckets / 2;
  if (n < max_exact) return bucket + n;
  // n in [max_exact, max_distance) maps log-linearly onto [max_exact, num_buckets).
  const double scaled = std::log(double(n) / double(max_exact)) / std::log(double(max_distance) / double(max_exact)) *
                        double(num_buckets - max_exact);
  return bucket + std::min(max_exact + int64_t(scaled), num_buckets - 1);
}

}  // namespace

int64_t relative_position_bucket(int64_t relative_position, bool bidirectional, int64_t num_buckets,
                                 int64_t max_distance) {
  check_buckets("mha::nn::relative_position_bucket", bidirectional, num_buckets, max_distance);
  return bucket_unchecked(relative_position, bidirectional, num_buckets, max_distance);
}

Tensor relative_position_buckets(int64_t L, int64_t S, int64_t offset, bool bidirectional, int64_t num_buckets,
                                 int64_t max_distance) {
  const char* fn = "mha::nn::relative_position_buckets";
  if (L <= 0) raise<ValueError>(fn, "L", "> 0", std::to_string(L));
  if (S <= 0) raise<ValueError>(fn, "S", "> 0", std::to_string(S));
  if (offset < 0) raise<ValueError>(fn, "offset", ">= 0", std::to_string(offset));
  check_buckets(fn, bidirectional, num_buckets, max_distance);
  Tensor buckets = Tensor::empty({L, S}, DType::int64);
  int64_t* b = buckets.data<int64_t>();
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < S; ++j) b[i * S + j] = bucket_unchecked(j - (offset + i), bidirectional, num_buckets, max_distance);
  return buckets;
}

std::vector<double> alibi_slopes(int64_t H) {
  if (H <= 0) raise<ValueError>("mha::nn::alibi_slopes", "H", "> 0", std::to_string(H));
  int64_t P = 1;
  while (2 * P <= H) P *= 2;
  // Powers of two: m_h = 2^(−8h/P). Otherwise the odd-numbered slopes of 2P,
  // 2^(−8(2h−1)/2P) = 2^(−4(2h−1)/P), fill the remaining H − P heads.
  std::vector<double> slopes;
  for (int64_t h = 1; h <= P; ++h) slopes.push_back(std::exp2(-8.0 * double(h) / double(P)));
  for (int64_t h = 1; h <= H - P; ++h) slopes.push_back(std::exp2(-4.0 * double(2 * h - 1) / double(P)));
  return slopes;
}

Tensor alibi_bias(int64_t H, int64_t L, int64_t S, int64_t offset, DType dtype) {
  const char* fn = "mha::nn::alibi_bias";
  if (L <= 0) raise<ValueError>(fn, "L", "> 0", std::to_string(L));
  if (S <= 0) raise<ValueError>(fn, "S", "> 0", std::to_string(S));
  if (offset < 0) raise<ValueError>(fn, "offset", ">= 0", std::to_string(offset));
  check_layer_dtype(dtype, fn);
  const std::vector<double> slopes = alibi_slopes(H);
  std::vector<double> values(size_t(H * L * S));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < S; ++j)
        values[size_t((h * L + i) * S + j)] = -slopes[size_t(h)] * double(std::abs(offset + i - j));
  return Tensor::from_values(values, {1, H, L, S}, dtype);
}

}  // namespace mha::nn
