// FMA peak: cpu/fma_rate.h's chains on every thread at once, timed over a
// fixed count.
#include "peak.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "cpu/fma_rate.h"

namespace mha::bench {

namespace {

constexpr long kIterations = 50'000'000;

// The shortest of five timings of f(), in seconds (each about 0.1 s here): a
// neighbour on the shared host can only slow a window down, and one FMA
// window alone once read 346 GFLOP/s where the others that hour read 443–528,
// which put a mid training step at "97% of the peak".
template <class F>
double shortest_of_five(F&& f) {
  double best = 0.0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = rep == 0 ? seconds : std::min(best, seconds);
  }
  return best;
}

double run(int threads, cpu::FmaKind kind) {
  if (!cpu::fma_supported(kind)) return 0.0;
  volatile float sink = cpu::fma_chains(kind, kIterations / 20);  // warm up the clock
  const double seconds = shortest_of_five([&] {
#pragma omp parallel num_threads(threads)
    { sink = sink + cpu::fma_chains(kind, kIterations); }
  });
  return cpu::fma_iteration_flops(kind) * double(kIterations) * threads / seconds / 1e9;
}

}  // namespace

double fma_peak_gflops(int threads, bool avx512) {
  return run(threads, avx512 ? cpu::FmaKind::f32_512 : cpu::FmaKind::f32_256);
}

double bf16_peak_gflops(int threads) { return run(threads, cpu::FmaKind::bf16_512); }

double copy_bandwidth_gbs(int threads) {
  constexpr size_t kBytes = size_t(128) << 20;
  std::vector<char> from(kBytes, 1), to(kBytes, 0);  // written once: every page resident
  const double seconds = shortest_of_five([&] {
#pragma omp parallel num_threads(threads)
    {
      const size_t n = size_t(omp_get_num_threads()), t = size_t(omp_get_thread_num());
      const size_t first = kBytes * t / n, last = kBytes * (t + 1) / n;
      std::memcpy(to.data() + first, from.data() + first, last - first);
    }
  });
  return 2.0 * double(kBytes) / seconds / 1e9;
}

}  // namespace mha::bench
