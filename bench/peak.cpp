// FMA peak: independent accumulator chains per thread (16 for 512-bit, 12 for
// 256-bit), enough to cover the FMA latency (4 cycles) on two pipes, timed
// over a fixed count.
#include "peak.h"

#include <immintrin.h>
#include <omp.h>

#include <chrono>

namespace mha::bench {

namespace {

constexpr long kIterations = 50'000'000;

#define MHA_REPEAT16(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)

__attribute__((target("avx512f"))) float chains512(long n) {
#define DECL(i) __m512 a##i = _mm512_set1_ps(0.01f * i);
  MHA_REPEAT16(DECL)
#undef DECL
  const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-4f);
  for (long it = 0; it < n; ++it) {
#define STEP(i) a##i = _mm512_fmadd_ps(a##i, b, c);
    MHA_REPEAT16(STEP)
#undef STEP
    __asm__ volatile("" ::: "memory");
  }
  float s = 0;
#define SUM(i) s += _mm512_reduce_add_ps(a##i);
  MHA_REPEAT16(SUM)
#undef SUM
  return s;
}

#define MHA_REPEAT12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

// AVX2 has 16 registers: 12 chains leave room for the two constants.
__attribute__((target("avx2,fma"))) float chains256(long n) {
#define DECL(i) __m256 a##i = _mm256_set1_ps(0.01f * i);
  MHA_REPEAT12(DECL)
#undef DECL
  const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-4f);
  for (long it = 0; it < n; ++it) {
#define STEP(i) a##i = _mm256_fmadd_ps(a##i, b, c);
    MHA_REPEAT12(STEP)
#undef STEP
    __asm__ volatile("" ::: "memory");
  }
  float out[8], s = 0;
#define SUM(i) _mm256_storeu_ps(out, a##i); for (float x : out) s += x;
  MHA_REPEAT12(SUM)
#undef SUM
  return s;
}

__attribute__((target("avx512f,avx512bf16"))) float chains_bf16(long n) {
#define DECL(i) __m512 a##i = _mm512_set1_ps(0.01f * i);
  MHA_REPEAT16(DECL)
#undef DECL
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3c00);
  for (long it = 0; it < n; ++it) {
#define STEP(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
    MHA_REPEAT16(STEP)
#undef STEP
    __asm__ volatile("" ::: "memory");
  }
  float s = 0;
#define SUM(i) s += _mm512_reduce_add_ps(a##i);
  MHA_REPEAT16(SUM)
#undef SUM
  return s;
}

template <class F>
double run(int threads, F chains, double flops_per_iteration) {
  volatile float sink = 0;
  chains(kIterations / 20);  // warm up the clock
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  { sink = sink + chains(kIterations); }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return flops_per_iteration * double(kIterations) * threads / seconds / 1e9;
}

}  // namespace

double fma_peak_gflops(int threads, bool avx512) {
  if (avx512) return __builtin_cpu_supports("avx512f") ? run(threads, chains512, 16 * 16 * 2) : 0.0;
  return __builtin_cpu_supports("avx2") ? run(threads, chains256, 12 * 8 * 2) : 0.0;
}

double bf16_peak_gflops(int threads) {
  if (!__builtin_cpu_supports("avx512bf16")) return 0.0;
  return run(threads, chains_bf16, 16 * 16 * 2 * 2);
}

}  // namespace mha::bench
