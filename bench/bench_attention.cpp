// Attention benchmark: fused and reference paths, forward and backward, in
// GFLOP/s next to the machine's measured FMA peak, plus peak extra memory.
// Not a test: it prints figures (markdown tables) and asserts nothing.
//
//   bench_attention              the table of docs/benchmarks.md
//   bench_attention --quick      a few rows
//   bench_attention --memory L   forward+backward of one head at L=S (E=64): peak extra MiB
//   bench_attention --shape BH L E causal threads reps [bfloat16] [keep]
//                                median forward and backward ms of one shape, float32 or
//                                bfloat16 (MHA_BF16_GEMM=dot|amx|widen picks its kernels; for scripts);
//                                keep: the forward keeps its scores for the backward (keep_scores_bytes)
//
// Memory is measured in a fresh process (this program run again with
// --memory-case), so that memory freed by earlier runs cannot hide a peak.
//
// FLOPs: forward 4·B·H·(visible query-key pairs)·E (Q·Kᵀ and P·V), backward
// 2.5× that (five products against two), as in ../shared/BASELINES.md.
#include <malloc.h>
#include <unistd.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "cpu/flash/dispatch.h"
#include "measure.h"
#include "mha/mha.h"
#include "peak.h"

using namespace mha;
using namespace mha::bench;

namespace {

struct Shape4 {
  int64_t BH, L, S, E;
};

// Visible (query, key) pairs of one head under the options' band.
double visible_pairs(int64_t L, int64_t S, const AttentionOptions& o) {
  double pairs = 0;
  const int64_t diag = S - L;
  for (int64_t i = 0; i < L; ++i) {
    int64_t lo = 0, hi = S;
    if (o.window_left >= 0) lo = std::max<int64_t>(lo, i + diag - o.window_left);
    if (o.window_right >= 0) hi = std::min<int64_t>(hi, i + diag + o.window_right + 1);
    if (o.causal == Causal::top_left) hi = std::min<int64_t>(hi, i + 1);
    if (o.causal == Causal::bottom_right) hi = std::min<int64_t>(hi, i + diag + 1);
    pairs += double(std::max<int64_t>(0, hi - lo));
  }
  return pairs;
}

struct Result {
  double fwd_s = 0, bwd_s = 0, fwd_gflops = 0, bwd_gflops = 0, extra_mib = 0;
};

// Peak extra MiB of one forward+backward, measured by a fresh copy of this program.
double memory_in_child(DType dtype, int64_t E, int64_t L, bool causal) {
  char cmd[256];
  std::snprintf(cmd, sizeof cmd, "/proc/%d/exe --memory-case %s %lld %lld %d", int(getpid()), to_string(dtype).c_str(),
                (long long)E, (long long)L, int(causal));
  FILE* pipe = popen(cmd, "r");
  double mib = -1;
  if (pipe) {
    if (std::fscanf(pipe, "%lf", &mib) != 1) mib = -1;
    pclose(pipe);
  }
  return mib;
}

Result measure(const Shape4& s, DType dtype, AttentionOptions o, int threads, int reps, bool memory) {
  omp_set_num_threads(threads);
  Generator gen(1);
  Tensor q = randn({s.BH, s.L, s.E}, gen, 0, 1, dtype), k = randn({s.BH, s.S, s.E}, gen, 0, 1, dtype),
         v = randn({s.BH, s.S, s.E}, gen, 0, 1, dtype), dout = randn({s.BH, s.L, s.E}, gen, 0, 1, dtype);
  const double flops = 4.0 * double(s.BH) * visible_pairs(s.L, s.S, o) * double(s.E);
  Result r;
  AttentionOutput f = attention_forward(q, k, v, o);  // warm-up (and page-in)
  attention_backward(dout, q, k, v, f, o);
  if (memory) r.extra_mib = memory_in_child(dtype, s.E, s.L, o.causal != Causal::none);
  r.fwd_s = median_seconds(reps, [&] { f = attention_forward(q, k, v, o); });
  r.bwd_s = median_seconds(reps, [&] { attention_backward(dout, q, k, v, f, o); });
  r.fwd_gflops = flops / r.fwd_s / 1e9;
  r.bwd_gflops = 2.5 * flops / r.bwd_s / 1e9;
  return r;
}

void print_peaks(double peaks[3][3]) {
  std::printf("Measured peaks (GFLOP/s), this program, independent FMA chains on every thread:\n\n");
  std::printf("| threads | FP32 FMA, 512-bit | FP32 FMA, 256-bit | BF16 dot products (dpbf16ps) |\n|---|---|---|---|\n");
  for (int t = 1; t <= 2; ++t)
    std::printf("| %d | %.0f | %.0f | %.0f |\n", t, peaks[t][0], peaks[t][1], peaks[t][2]);
  std::printf("\n");
}

// One forward+backward at B·H = 8 in this fresh process; prints the peak extra MiB.
int memory_case(char** argv) {
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  const DType dtype = std::string(argv[0]) == "bfloat16" ? DType::bfloat16 : DType::float32;
  const int64_t E = std::atoll(argv[1]), L = std::atoll(argv[2]);
  const AttentionOptions o{.causal = std::atoi(argv[3]) ? Causal::top_left : Causal::none, .path = AttentionPath::fused};
  Generator gen(1);
  Tensor q = randn({8, L, E}, gen, 0, 1, dtype), k = randn({8, L, E}, gen, 0, 1, dtype),
         v = randn({8, L, E}, gen, 0, 1, dtype), dout = randn({8, L, E}, gen, 0, 1, dtype);
  std::printf("%.1f\n", peak_extra_mib([&] { attention_backward(dout, q, k, v, attention_forward(q, k, v, o), o); }));
  return 0;
}

int memory_mode(int64_t L) {
  mallopt(M_MMAP_THRESHOLD, 1 << 20);  // big blocks go back to the system when freed
  omp_set_num_threads(2);
  Generator gen(1);
  Tensor q = randn({1, L, 64}, gen), k = randn({1, L, 64}, gen), v = randn({1, L, 64}, gen), d = randn({1, L, 64}, gen);
  const double io_mib = 4.0 * double(L) * 64 * 4 / (1 << 20);
  double extra = 0;
  const double s = seconds_of([&] {
    extra = peak_extra_mib([&] {
      AttentionOutput f = attention_forward(q, k, v);
      attention_backward(d, q, k, v, f);
    });
  });
  // Outputs and gradients: out, lse, dq, dk, dv.
  const double outputs_mib = (4.0 * double(L) * 64 + double(L)) * 4 / (1 << 20);
  std::printf("L=S=%lld, E=64, one head, float32, forward+backward on 2 threads: %.1f s\n", (long long)L, s);
  std::printf("inputs %.1f MiB (q, k, v, dout); peak extra resident %.1f MiB, of which outputs and gradients %.1f MiB:"
              " %.1f MiB beyond them\n",
              io_mib, extra, outputs_mib, extra - outputs_mib);
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  bool quick = false;
  int64_t reference_max = 1024;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--memory") && i + 1 < argc) return memory_mode(std::atoll(argv[++i]));
    else if (!std::strcmp(argv[i], "--memory-case") && i + 4 < argc) return memory_case(argv + i + 1);
    else if (!std::strcmp(argv[i], "--shape") && i + 6 < argc) {
      const Shape4 s{std::atoll(argv[i + 1]), std::atoll(argv[i + 2]), std::atoll(argv[i + 2]), std::atoll(argv[i + 3])};
      AttentionOptions o{.causal = std::atoi(argv[i + 4]) ? Causal::top_left : Causal::none};
      DType dtype = DType::float32;
      for (int x = i + 7; x < argc; ++x) {
        if (!std::strcmp(argv[x], "bfloat16")) dtype = DType::bfloat16;
        else if (!std::strcmp(argv[x], "keep")) o.keep_scores_bytes = int64_t(1) << 40;
      }
      const Result r = measure(s, dtype, o, std::atoi(argv[i + 5]), std::atoi(argv[i + 6]), false);
      std::printf("%.3f %.3f\n", r.fwd_s * 1e3, r.bwd_s * 1e3);
      return 0;
    }
    else if (!std::strcmp(argv[i], "--reference-max") && i + 1 < argc) reference_max = std::atoll(argv[++i]);
    else {
      std::fprintf(stderr, "usage: bench_attention [--quick] [--reference-max L] [--memory L]\n");
      return 2;
    }
  }
  std::printf("CPU: %s, %d cores; mha %s, fused kernels: %s\n\n", cpu_name().c_str(), omp_get_num_procs(), version,
              cpu::to_string(cpu::active_isa()).c_str());
  double peaks[3][3] = {};
  for (int t = 1; t <= 2; ++t) {
    peaks[t][0] = bench::fma_peak_gflops(t, true);
    peaks[t][1] = bench::fma_peak_gflops(t, false);
    peaks[t][2] = bench::bf16_peak_gflops(t);
  }
  print_peaks(peaks);
  const double fp32_peak[3] = {0, std::max(peaks[1][0], peaks[1][1]), std::max(peaks[2][0], peaks[2][1])};

  std::printf("B·H = 8, L = S; GFLOP/s (median of the runs); %% = fused forward / the measured peak at that thread count (FP32 FMA for float32, BF16 dot products for bfloat16);"
              " extra MiB = peak resident memory of one forward+backward beyond the inputs, outputs included (fresh process, 2 threads).\n\n");
  std::printf("| dtype | E | L=S | causal | threads | fused fwd | fused bwd | %% peak fwd | fwd ms | bwd ms | extra MiB |"
              " reference fwd | reference bwd |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  const std::vector<int64_t> lengths = quick ? std::vector<int64_t>{512, 4096} : std::vector<int64_t>{512, 1024, 4096, 16384};
  for (DType dtype : {DType::float32, DType::bfloat16})
    for (int64_t E : {64, 128}) {
      if (quick && E == 128) continue;
      for (int64_t L : lengths)
        for (bool causal : {false, true})
          for (int threads : {1, 2}) {
            const int reps = L >= 16384 ? 1 : (L >= 4096 ? 3 : 5);
            AttentionOptions o{.causal = causal ? Causal::top_left : Causal::none, .path = AttentionPath::fused};
            const Shape4 s{8, L, L, E};
            const Result f = measure(s, dtype, o, threads, reps, threads == 2);
            std::string ref_f = "—", ref_b = "—";
            if (L <= reference_max && dtype == DType::float32) {
              o.path = AttentionPath::reference;
              const Result r = measure(s, dtype, o, threads, 1, false);
              ref_f = std::to_string(int(r.fwd_gflops * 10 + 0.5) / 10.0).substr(0, 4);
              ref_b = std::to_string(int(r.bwd_gflops * 10 + 0.5) / 10.0).substr(0, 4);
            }
            char mem[32] = "";
            if (threads == 2) std::snprintf(mem, sizeof mem, "%.0f", f.extra_mib);
            std::printf("| %s | %lld | %lld | %s | %d | %.0f | %.0f | %.0f%% | %.1f | %.1f | %s | %s | %s |\n",
                        to_string(dtype).c_str(), (long long)E, (long long)L, causal ? "yes" : "no", threads,
                        f.fwd_gflops, f.bwd_gflops,
                        100 * f.fwd_gflops / (dtype == DType::bfloat16 && peaks[threads][2] > 0 ? peaks[threads][2] : fp32_peak[threads]),
                        f.fwd_s * 1e3,
                        f.bwd_s * 1e3, mem, ref_f.c_str(), ref_b.c_str());
            std::fflush(stdout);
          }
    }

  std::printf("\nSliding window vs full attention, float32, E=64, B·H=8, L=S=16384, 2 threads:\n\n");
  std::printf("| attention | fwd ms | bwd ms | fwd speed-up | bwd speed-up |\n|---|---|---|---|---|\n");
  const Shape4 s{8, 16384, 16384, 64};
  const Result full = measure(s, DType::float32, {.path = AttentionPath::fused}, 2, 1, false);
  const Result window =
      measure(s, DType::float32, {.window_left = 128, .window_right = 127, .path = AttentionPath::fused}, 2, 3, false);
  std::printf("| full | %.0f | %.0f | 1.0 | 1.0 |\n", full.fwd_s * 1e3, full.bwd_s * 1e3);
  std::printf("| window 256 (128 left, 127 right) | %.1f | %.1f | %.1f | %.1f |\n", window.fwd_s * 1e3,
              window.bwd_s * 1e3, full.fwd_s / window.fwd_s, full.bwd_s / window.bwd_s);
  return 0;
} catch (const std::exception& e) {
  return mha::bench::failed(argv[0], e);
}
