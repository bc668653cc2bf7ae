// The small vector layer the fused kernels are written against: one float
// vector type per instruction set, all with the same interface.
//
//   W                       lanes
//   load(p) / store(p)      unaligned
//   load_partial(p, n)      lanes >= n read as 0 (n < W)
//   load_bf16(p)            W bfloat16 values (their bits, uint16_t) widened to float: exact
//   load_bf16_partial(p, n) the same, lanes >= n read as 0 (n < W)
//   store_partial(p, n)
//   store_bf16(p)           W lanes rounded to bfloat16 (nearest even; NaN stays NaN, quiet),
//                           as bfloat16::round_from, written as their bits (uint16_t)
//   store_bf16_partial(p, n) the first n of them (n < W)
//   stream(p)               a streaming (non-temporal) store, p aligned to the vector;
//                           stream_fence() orders them before later stores (portable: plain)
//   set1(x), zero()
//   fma(a, b, c) = a·b + c, +, -, *, /, max(a, b), min(a, b), sqrt(a), abs(a)
//   mul_rounded(a, b)       a·b rounded to float, never fused into the add or
//                           subtract that uses it (the compiler fuses a·b - c
//                           into one fma otherwise: one rounding, not two)
//   select_gt(a, b, x, y)   a > b ? x : y, lane by lane (false for NaN)
//   reduce_add(a)           the sum of the lanes, in a fixed order
//   reduce_add4(acc, out)   out[u] = the sum of acc[u]'s lanes, u < 4, each in one
//                           fixed order, the same for every u (not always reduce_add's)
//   exp2(x)                 2^x, relative error < 1.2e-7; exactly 0 for x < -126 (and -inf), never a
//                           subnormal; NaN for NaN
//
// max(a, b) and min(a, b) return b when either is NaN (as vmaxps does).
//
// Include this file only from a kernel translation unit that defines
// MHA_SIMD_AVX512, MHA_SIMD_AVX2 or neither (portable), compiled with the
// matching flags. Everything here sits in namespace MHA_ISA_NAMESPACE, so the
// copies built for different instruction sets never meet at link time.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/simd/unroll.h"

#if defined(MHA_SIMD_AVX512) || defined(MHA_SIMD_AVX2)
#include <immintrin.h>
#endif

#ifndef MHA_ISA_NAMESPACE
#error "define MHA_ISA_NAMESPACE before including cpu/simd/vec.h"
#endif

namespace mha::cpu::MHA_ISA_NAMESPACE {

// 2^f on f in [-0.5, 0.5]: minimax polynomial (Cephes exp2f coefficients).
#define MHA_EXP2_POLY(F, FMA, SET1)                                                      \
  FMA(FMA(FMA(FMA(FMA(FMA(SET1(1.535336188319500e-4f), F, SET1(1.339887440266574e-3f)), \
                      F, SET1(9.618437357674640e-3f)),                                    \
                  F, SET1(5.550332471162809e-2f)),                                        \
              F, SET1(2.402264791363012e-1f)),                                            \
          F, SET1(6.931472028550421e-1f)),                                                \
      F, SET1(1.0f))

#if defined(MHA_SIMD_AVX512)

struct Vec {
  static constexpr int W = 16;
  __m512 v;

  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load_partial(const float* p, int n) { return {_mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p)}; }
  // A bfloat16 is a float32's high half: zero-extend each to 32 bits, shift up.
  static Vec widen(__m256i bits) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))}; }
  static Vec load_bf16(const uint16_t* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static Vec load_bf16_partial(const uint16_t* p, int n) { return widen(_mm256_maskz_loadu_epi16(__mmask16((1u << n) - 1), p)); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store_partial(float* p, int n) const { _mm512_mask_storeu_ps(p, __mmask16((1u << n) - 1), v); }
  void stream(float* p) const { _mm512_stream_ps(p, v); }
  // bfloat16::round_from on every lane: add 0x7fff plus the lowest kept bit,
  // keep the top half; a NaN keeps its top half with the quiet bit set.
  // u is held in a register: where v came straight from memory, the compiler
  // folded its load into each of u's three uses, and a streaming pass that
  // loaded every line three times ran at two thirds of the speed (Zen 5).
  __m256i bf16_bits() const {
    __m512i u = _mm512_castps_si512(v);
    asm("" : "+v"(u));
    const __m512i top = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(top, _mm512_set1_epi32(1)));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(top, _mm512_set1_epi32(0x40))));
  }
  void store_bf16(uint16_t* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits()); }
  void store_bf16_partial(uint16_t* p, int n) const {
    _mm256_mask_storeu_epi16(p, __mmask16((1u << n) - 1), bf16_bits());
  }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static Vec zero() { return {_mm512_setzero_ps()}; }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Vec mul_rounded(Vec a, Vec b) {
    __m512 p = _mm512_mul_ps(a.v, b.v);
    asm("" : "+v"(p));  // the compiler sees no product here to fuse
    return {p};
  }
  friend Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
  friend Vec min(Vec a, Vec b) { return {_mm512_min_ps(a.v, b.v)}; }
  friend Vec sqrt(Vec a) { return {_mm512_sqrt_ps(a.v)}; }
  friend Vec abs(Vec a) { return {_mm512_abs_ps(a.v)}; }
  friend Vec select_gt(Vec a, Vec b, Vec x, Vec y) {
    return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ), y.v, x.v)};
  }
  friend float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
  friend void reduce_add4(const Vec (&acc)[4], float* out) {
    for (int u = 0; u < 4; ++u) out[u] = reduce_add(acc[u]);
  }
  friend Vec exp2(Vec x) {
    // Results below 2^-126 are 0, not subnormal: a subnormal or underflowing
    // result costs a microcode assist of ~150 cycles (FTZ is off), and every
    // masked score (-inf) used to take one, 70% of the fused backward's time
    // at L = 43 (perf annotate: the store after vscalefps). Zero-masking skips
    // those lanes. NaN compares not-less (unordered) and passes through;
    // scalef saturates large n to inf.
    const __mmask16 normal = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    const __m512 n = _mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x.v, n);
    const __m512 p = MHA_EXP2_POLY(f, _mm512_fmadd_ps, _mm512_set1_ps);
    return {_mm512_maskz_scalef_ps(normal, p, n)};
  }
};

#elif defined(MHA_SIMD_AVX2)

struct Vec {
  static constexpr int W = 8;
  __m256 v;

  static __m256i lanes_below(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load_partial(const float* p, int n) { return {_mm256_maskload_ps(p, lanes_below(n))}; }
  static Vec widen(__m128i bits) { return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16))}; }
  static Vec load_bf16(const uint16_t* p) { return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static Vec load_bf16_partial(const uint16_t* p, int n) {  // no masked 16-bit load before AVX-512
    uint16_t bits[W] = {};
    std::memcpy(bits, p, size_t(n) * sizeof(uint16_t));
    return load_bf16(bits);
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store_partial(float* p, int n) const { _mm256_maskstore_ps(p, lanes_below(n), v); }
  void stream(float* p) const { _mm256_stream_ps(p, v); }
  // As on AVX-512; the 32-bit lanes (each ≤ 0xffff) packed to 16 bits within
  // the halves, then the halves' low quarters brought together.
  __m128i bf16_bits() const {
    __m256i u = _mm256_castps_si256(v);
    asm("" : "+x"(u));  // (in a register, as on AVX-512)
    const __m256i top = _mm256_srli_epi32(u, 16);
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(top, _mm256_set1_epi32(1)));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i bits = _mm256_blendv_epi8(rounded, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08));
  }
  void store_bf16(uint16_t* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits()); }
  void store_bf16_partial(uint16_t* p, int n) const {
    uint16_t bits[W];
    store_bf16(bits);
    std::memcpy(p, bits, size_t(n) * sizeof(uint16_t));
  }
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Vec zero() { return {_mm256_setzero_ps()}; }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend Vec mul_rounded(Vec a, Vec b) {
    __m256 p = _mm256_mul_ps(a.v, b.v);
    asm("" : "+x"(p));  // the compiler sees no product here to fuse
    return {p};
  }
  friend Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
  friend Vec min(Vec a, Vec b) { return {_mm256_min_ps(a.v, b.v)}; }
  friend Vec sqrt(Vec a) { return {_mm256_sqrt_ps(a.v)}; }
  friend Vec abs(Vec a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
  friend Vec select_gt(Vec a, Vec b, Vec x, Vec y) {
    return {_mm256_blendv_ps(y.v, x.v, _mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ))};
  }
  friend float reduce_add(Vec a) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
  }
  // Each sum ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)): three hadds
  // and one add for the four, where four reduce_adds take six operations each.
  friend void reduce_add4(const Vec (&acc)[4], float* out) {
    const __m256 ab = _mm256_hadd_ps(acc[0].v, acc[1].v), cd = _mm256_hadd_ps(acc[2].v, acc[3].v);
    const __m256 abcd = _mm256_hadd_ps(ab, cd);  // halves: the four sums of lanes 0-3, of lanes 4-7
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
  friend Vec exp2(Vec x) {
    // x second in the clamps: a NaN passes through (and, as NaN · 2^n, comes out NaN).
    // Below -126 the result is 0 (as on AVX-512: never a subnormal, whose
    // product would cost a microcode assist); NaN compares not-less.
    const __m256 normal = _mm256_cmp_ps(x.v, _mm256_set1_ps(-126.0f), _CMP_NLT_UQ);
    x.v = _mm256_max_ps(_mm256_set1_ps(-126.0f), x.v);
    x.v = _mm256_min_ps(_mm256_set1_ps(127.0f), x.v);
    const __m256 n = _mm256_round_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x.v, n);
    const __m256 p = MHA_EXP2_POLY(f, _mm256_fmadd_ps, _mm256_set1_ps);
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return {_mm256_and_ps(normal, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)))};
  }
};

#else  // portable: plain arrays the compiler may vectorise for the baseline ISA

struct Vec {
  static constexpr int W = 8;
  float v[W];

  static Vec load(const float* p) {
    Vec r;
    for (int i = 0; i < W; ++i) r.v[i] = p[i];
    return r;
  }
  static Vec load_partial(const float* p, int n) {
    Vec r = zero();
    for (int i = 0; i < n; ++i) r.v[i] = p[i];
    return r;
  }
  static Vec load_bf16_partial(const uint16_t* p, int n) {
    Vec r = zero();
    for (int i = 0; i < n; ++i) {
      const uint32_t bits = uint32_t(p[i]) << 16;
      std::memcpy(&r.v[i], &bits, sizeof(float));
    }
    return r;
  }
  static Vec load_bf16(const uint16_t* p) { return load_bf16_partial(p, W); }
  void store(float* p) const {
    for (int i = 0; i < W; ++i) p[i] = v[i];
  }
  void store_partial(float* p, int n) const {
    for (int i = 0; i < n; ++i) p[i] = v[i];
  }
  void stream(float* p) const { store(p); }
  void store_bf16_partial(uint16_t* p, int n) const {
    for (int i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, &v[i], 4);
      const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      p[i] = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
    }
  }
  void store_bf16(uint16_t* p) const { store_bf16_partial(p, W); }
  static Vec set1(float x) {
    Vec r;
    for (int i = 0; i < W; ++i) r.v[i] = x;
    return r;
  }
  static Vec zero() { return set1(0.0f); }
  friend Vec fma(Vec a, Vec b, Vec c) {
    for (int i = 0; i < W; ++i) c.v[i] = a.v[i] * b.v[i] + c.v[i];
    return c;
  }
  friend Vec operator+(Vec a, Vec b) {
    for (int i = 0; i < W; ++i) a.v[i] += b.v[i];
    return a;
  }
  friend Vec operator-(Vec a, Vec b) {
    for (int i = 0; i < W; ++i) a.v[i] -= b.v[i];
    return a;
  }
  friend Vec operator*(Vec a, Vec b) {
    for (int i = 0; i < W; ++i) a.v[i] *= b.v[i];
    return a;
  }
  friend Vec mul_rounded(Vec a, Vec b) {
    for (int i = 0; i < W; ++i) {
      a.v[i] *= b.v[i];
      asm("" : "+m"(a.v[i]));
    }
    return a;
  }
  friend Vec max(Vec a, Vec b) {
    for (int i = 0; i < W; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
    return a;
  }
  friend Vec operator/(Vec a, Vec b) {
    for (int i = 0; i < W; ++i) a.v[i] /= b.v[i];
    return a;
  }
  friend Vec min(Vec a, Vec b) {
    for (int i = 0; i < W; ++i) a.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i];
    return a;
  }
  friend Vec sqrt(Vec a) {
    for (int i = 0; i < W; ++i) a.v[i] = __builtin_sqrtf(a.v[i]);
    return a;
  }
  friend Vec abs(Vec a) {
    for (int i = 0; i < W; ++i) a.v[i] = __builtin_fabsf(a.v[i]);
    return a;
  }
  friend Vec select_gt(Vec a, Vec b, Vec x, Vec y) {
    for (int i = 0; i < W; ++i) x.v[i] = a.v[i] > b.v[i] ? x.v[i] : y.v[i];
    return x;
  }
  friend float reduce_add(Vec a) {  // pairwise, as the SIMD paths' halving
    for (int w = W / 2; w > 0; w /= 2)
      for (int i = 0; i < w; ++i) a.v[i] += a.v[i + w];
    return a.v[0];
  }
  friend void reduce_add4(const Vec (&acc)[4], float* out) {
    for (int u = 0; u < 4; ++u) out[u] = reduce_add(acc[u]);
  }
  static float exp2_scalar(float x) {
    if (x != x) return x;  // NaN (converting it to an integer below is undefined)
    if (x < -126.0f) return 0.0f;  // never a subnormal, as the SIMD paths
    x = x > 127.0f ? 127.0f : x;
    // Round half away from zero, matching neither SIMD path bit for bit but
    // with the same accuracy: f stays in [-0.5, 0.5].
    const float n = float(int32_t(x >= 0 ? x + 0.5f : x - 0.5f));
    const float f = x - n;
    auto mul_add = [](float a, float b, float c) { return a * b + c; };
    auto same = [](float c) { return c; };
    const float p = MHA_EXP2_POLY(f, mul_add, same);
    const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
  }
  friend Vec exp2(Vec x) {
    for (int i = 0; i < W; ++i) x.v[i] = exp2_scalar(x.v[i]);
    return x;
  }
};

#endif

#if defined(MHA_SIMD_AVX512) || defined(MHA_SIMD_AVX2)
inline void stream_fence() { _mm_sfence(); }
#else
inline void stream_fence() {}
#endif

#undef MHA_EXP2_POLY

}  // namespace mha::cpu::MHA_ISA_NAMESPACE
