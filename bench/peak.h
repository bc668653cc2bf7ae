// The machine's FMA peak, measured: independent FMA chains on every thread.
#pragma once

namespace mha::bench {

// GFLOP/s of float32 FMAs (2 flops each) on `threads` threads, with 512-bit
// vectors when avx512 is true, else 256-bit; the best of five timings.
double fma_peak_gflops(int threads, bool avx512);
// GFLOP/s of AVX512-BF16 dot products (_mm512_dpbf16_ps: 64 flops each), the best of five; 0 without AVX512-BF16.
double bf16_peak_gflops(int threads);
// GB/s (bytes read plus bytes written) of a copy between two 128 MiB buffers,
// each thread its share, best of five: the memory bandwidth a step can have
// now. On a shared host it moves with the neighbours' load, and a memory-bound
// run (PyTorch's long step) with it.
double copy_bandwidth_gbs(int threads);

}  // namespace mha::bench
