// FMA throughput, measured: independent accumulator chains, enough of them
// to cover the FMA latency (4 cycles) on two pipes (16 chains for 512-bit
// vectors, 12 for 256-bit, which leave room for the two constants in AVX2's
// 16 registers). The benchmarks' peak (bench/peak.h) runs them on every
// thread; the library times them once to learn whether 512-bit vectors
// double the 256-bit rate on this core (gemm.cpp).
#pragma once

namespace mha::cpu {

enum class FmaKind {
  f32_512,   // _mm512_fmadd_ps: 32 flops
  f32_256,   // _mm256_fmadd_ps: 16 flops
  bf16_512,  // _mm512_dpbf16_ps: 64 flops
};

// Whether this CPU runs `kind` at all.
bool fma_supported(FmaKind kind);
// Flops of one iteration of fma_chains (every chain advanced once).
double fma_iteration_flops(FmaKind kind);
// `iterations` rounds over the chains; the chains' sum, for the caller to
// keep (so that the work is not optimised away). Requires fma_supported.
float fma_chains(FmaKind kind, long iterations);
// GFLOP/s of `kind` on the calling thread: the best of `repeats` timed runs
// of `iterations` each, after one untimed run (to wake the clock up).
double fma_gflops_one_thread(FmaKind kind, long iterations, int repeats);

// Whether this core executes 512-bit FMAs at (about) twice its 256-bit rate —
// two full-width pipes (Xeons since Skylake-SP, AMD Zen 5 server parts) rather
// than 512-bit instructions split over 256-bit pipes (Zen 4). Measured on
// the first call (about 2 ms), then remembered; false without AVX-512.
bool avx512_doubles_fma_rate();

}  // namespace mha::cpu
