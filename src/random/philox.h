// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011): a counter-based generator. Output = bijection(counter; key), so any
// element of a random stream is computed directly from its index.
#pragma once

#include <array>
#include <cstdint>

namespace mha {

using PhiloxBlock = std::array<uint32_t, 4>;

inline PhiloxBlock philox4x32(PhiloxBlock ctr, uint64_t key64) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t k0 = uint32_t(key64), k1 = uint32_t(key64 >> 32);
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = uint64_t(kMul0) * ctr[0];
    uint64_t p1 = uint64_t(kMul1) * ctr[2];
    ctr = {uint32_t(p1 >> 32) ^ ctr[1] ^ k0, uint32_t(p1), uint32_t(p0 >> 32) ^ ctr[3] ^ k1,
           uint32_t(p0)};
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return ctr;
}

// Block `index` of the stream (seed, stream): four 32-bit words.
inline PhiloxBlock philox_block(uint64_t seed, uint64_t stream, uint64_t index) {
  return philox4x32({uint32_t(index), uint32_t(index >> 32), uint32_t(stream), uint32_t(stream >> 32)},
                    seed);
}

// Dropout: element (b, i, j) of an attention matrix is kept when its word is
// >= threshold(p). Words come four at a time: block (b, i, j / 4), word j % 4,
// so a kernel that walks j in steps of 4 draws one block per step.
inline uint32_t dropout_threshold(double p) {
  double t = p * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : uint32_t(t);
}

inline uint32_t dropout_word(uint64_t seed, uint64_t b, uint64_t i, uint64_t j) {
  return philox4x32({uint32_t(j >> 2), uint32_t(i), uint32_t(b), uint32_t(b >> 32)}, seed)[j & 3];
}

inline bool dropout_keep(uint64_t seed, uint64_t b, uint64_t i, uint64_t j, uint32_t threshold) {
  return dropout_word(seed, b, i, j) >= threshold;
}

}  // namespace mha
