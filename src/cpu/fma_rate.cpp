#include "cpu/fma_rate.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>

namespace mha::cpu {

namespace {

#define MHA_REPEAT16(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#define MHA_REPEAT12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

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
#define SUM(i)                    \
  _mm256_storeu_ps(out, a##i);    \
  for (float x : out) s += x;
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

#undef MHA_REPEAT12
#undef MHA_REPEAT16

}  // namespace

bool fma_supported(FmaKind kind) {
  switch (kind) {
    case FmaKind::f32_512: return __builtin_cpu_supports("avx512f");
    case FmaKind::f32_256: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case FmaKind::bf16_512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  }
  return false;
}

double fma_iteration_flops(FmaKind kind) {
  switch (kind) {
    case FmaKind::f32_512: return 16 * 16 * 2;
    case FmaKind::f32_256: return 12 * 8 * 2;
    case FmaKind::bf16_512: return 16 * 16 * 2 * 2;
  }
  return 0;
}

float fma_chains(FmaKind kind, long iterations) {
  switch (kind) {
    case FmaKind::f32_512: return chains512(iterations);
    case FmaKind::f32_256: return chains256(iterations);
    case FmaKind::bf16_512: return chains_bf16(iterations);
  }
  return 0;
}

namespace {

// GFLOP/s of one timed run of `iterations`.
double timed_gflops(FmaKind kind, long iterations, volatile float& sink) {
  const auto t0 = std::chrono::steady_clock::now();
  sink = sink + fma_chains(kind, iterations);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return seconds > 0 ? fma_iteration_flops(kind) * double(iterations) / seconds / 1e9 : 0.0;
}

}  // namespace

double fma_gflops_one_thread(FmaKind kind, long iterations, int repeats) {
  volatile float sink = fma_chains(kind, iterations);
  double best = 0;
  for (int r = 0; r < repeats; ++r) best = std::max(best, timed_gflops(kind, iterations, sink));
  return best;
}

bool avx512_doubles_fma_rate() {
  // 50k iterations: 800k FMAs, ~0.1 ms at 2 a cycle. Full-width pipes give
  // a ratio of ~2, split ones ~1: 1.5 separates them with room for noise.
  // The two kinds alternate, after ~3 ms of warm-up, so that a clock still
  // rising (a process just started) or a moment of preemption cannot favour
  // one kind: each keeps its best of eight.
  static const bool doubles = [] {
    if (!fma_supported(FmaKind::f32_512) || !fma_supported(FmaKind::f32_256)) return false;
    const long n = 50000;
    volatile float sink = fma_chains(FmaKind::f32_512, 30 * n);
    double wide = 0, narrow = 0;
    for (int round = 0; round < 8; ++round) {
      wide = std::max(wide, timed_gflops(FmaKind::f32_512, n, sink));
      narrow = std::max(narrow, timed_gflops(FmaKind::f32_256, n, sink));
    }
    return narrow > 0 && wide > 1.5 * narrow;
  }();
  return doubles;
}

}  // namespace mha::cpu
