// Element types and devices.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace mha {

// int64 holds indices (token ids, class labels).
enum class DType : uint8_t { float32, float64, bfloat16, boolean, int64 };

enum class Device : uint8_t { cpu, cuda };

// Bytes per element.
constexpr int64_t dtype_size(DType t) {
  switch (t) {
    case DType::float32: return 4;
    case DType::float64: return 8;
    case DType::bfloat16: return 2;
    case DType::boolean: return 1;
    case DType::int64: return 8;
  }
  return 0;
}

constexpr bool is_floating(DType t) {
  return t == DType::float32 || t == DType::float64 || t == DType::bfloat16;
}

std::string to_string(DType t);
std::string to_string(Device d);

// bfloat16: the top 16 bits of an IEEE float32. Conversion from float rounds
// to nearest even; NaN stays NaN (quiet).
struct bfloat16 {
  uint16_t bits = 0;

  bfloat16() = default;
  explicit bfloat16(float f) : bits(round_from(f)) {}
  explicit operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }

  static uint16_t round_from(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
  }
};

}  // namespace mha
