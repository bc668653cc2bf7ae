// float32 products at the training step's shapes, mha's own kernel
// (cpu/sgemm, through cpu::gemm as the layers call it) against OpenBLAS (cblas_sgemm; its kernel set is whatever it
// detected, see openblas_get_corename, or OPENBLAS_CORETYPE): median GFLOP/s.
// Shapes per configuration: the forward x·Wᵀ (M = B·T rows, N = out, K = in),
// the input gradient dy·W (M rows, N = in, K = out) and the weight gradient
// dyᵀ·x (M = out, N = in, K = rows), for the attention projections and both
// feed-forward layers. A third column times OpenBLAS as the layers call it
// (cpu::gemm: rows or columns split over OpenMP's threads, one OpenBLAS
// thread each; cpu/gemm.cpp; 0.0 where the layers do not use OpenBLAS,
// whose kernels are then older than the CPU). A fourth times the bfloat16
// product of bf16-mixed training (cpu::gemm on bfloat16 operands, float32
// C: AMX tiles, vdpbf16ps or widened to float32 as cpu::bf16_products()
// chose, or MHA_BF16_GEMM says), counted at the same 2·M·N·K FLOPs. A fifth times
// BLIS 0.9 (Debian's libblis4-openmp, on OpenMP's threads) where it is
// installed: loaded with dlopen and RTLD_LOCAL, so that its CBLAS and BLAS
// symbols cannot take the place of OpenBLAS's in this process; on the
// instruction set mha's kernels run (BLIS 0.9 cannot count the FMA units of
// newer Xeons and falls back to its 256-bit haswell kernels there, and with
// MHA_ISA=avx2 the comparison is between 256-bit kernels) unless
// BLIS_ARCH_TYPE is set; 0.0 where it is not installed.
// The decode1, decode2 and decode16 configurations time the forward products
// of one decoding step of the mid model (d 256, ff 1024) for 1, 2 and 16
// sequences: the skinny path of every backend (cpu/skinny.h).
//   build/bench/bench_gemm [--reps 7] [--config mid] [--product "ff1 dW"]
//   build/bench/bench_gemm --config decode2 --reps 301
#include <cblas.h>
#include <dlfcn.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cpu/flash/dispatch.h"
#include "cpu/gemm.h"
#include "cpu/sgemm/sgemm.h"
#include "measure.h"

namespace {

// BLIS's typed product (blis.h: dim_t and inc_t are 64-bit on x86_64 builds;
// trans_t's transpose bit is 1 << 3).
using BliSgemm = void (*)(int transa, int transb, int64_t m, int64_t n, int64_t k, const float* alpha, const float* a,
                          int64_t rsa, int64_t csa, const float* b, int64_t rsb, int64_t csb, const float* beta,
                          float* c, int64_t rsc, int64_t csc);
constexpr int kBlisTranspose = 1 << 3;

// BLIS 0.9 reads BLIS_ARCH_TYPE as the number of its arch_t, through atoi:
// 0 skx, 3 haswell (6 zen3). A name reads as 0: "haswell" ran the skx kernels
// on an AVX-512 Zen 5 (BLIS_ARCH_DEBUG=1 names the sub-configuration).
BliSgemm load_blis(mha::cpu::Isa isa) {
  if (isa != mha::cpu::Isa::scalar) setenv("BLIS_ARCH_TYPE", isa == mha::cpu::Isa::avx512 ? "0" : "3", 0);
  void* lib = dlopen("libblis.so.4", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return nullptr;
  if (auto set_threads = reinterpret_cast<void (*)(int64_t)>(dlsym(lib, "bli_thread_set_num_threads")))
    set_threads(omp_get_max_threads());
  return reinterpret_cast<BliSgemm>(dlsym(lib, "bli_sgemm"));
}

}  // namespace

int main(int argc, char** argv) try {
  using namespace mha;
  CLI::App app{"float32 GEMM at a training step's shapes: mha's kernel against OpenBLAS"};
  int reps = 7;
  app.add_option("--reps", reps, "Timed repetitions (median)")->capture_default_str();
  std::string only;
  app.add_option("--config", only,
                 "Only this configuration's products (small, mid, wide, long, decode1, decode2 or decode16; default all)");
  std::string only_product;
  app.add_option("--product", only_product, "Only this product (\"ff1 dW\", say; default all)");
  CLI11_PARSE(app, argc, argv);
  struct Config {
    const char* name;
    int64_t rows, d, ff;
    bool forward_only = false;  // a decoding step: no backward
  };
  const Config configs[] = {{"small", 32 * 43, 64, 256},          {"mid", 16 * 131, 256, 1024},
                            {"wide", 8 * 509, 512, 2048},         {"long", 2 * 2039, 256, 1024},
                            {"decode1", 1, 256, 1024, true},      {"decode2", 2, 256, 1024, true},
                            {"decode16", 16, 256, 1024, true}};
  const cpu::Isa isa = cpu::active_isa();
  const bool avx512 = isa == cpu::Isa::avx512;
  const BliSgemm blis_sgemm = load_blis(isa);
  std::printf("# %s, %d threads, OpenBLAS core %s, mha kernel %s, the layers' products: %s\n", bench::cpu_name().c_str(),
              omp_get_max_threads(), openblas_get_corename(), avx512 ? "avx512" : "avx2",
              cpu::to_string(cpu::sgemm_backend()).c_str());
  std::printf("# bfloat16 products: %s; BLIS: %s\n", cpu::to_string(cpu::bf16_products()).c_str(),
              blis_sgemm ? (std::string("libblis.so.4, BLIS_ARCH_TYPE=") + (getenv("BLIS_ARCH_TYPE") ? getenv("BLIS_ARCH_TYPE") : "(detected)")).c_str()
                         : "not installed (libblis4-openmp)");
  std::printf("%-6s %-12s %6s %6s %6s %3s %3s %10s %10s %10s %10s %10s\n", "config", "product", "M", "N", "K", "tA", "tB",
              "mha GF/s", "BLAS GF/s", "split GF/s", "bf16 GF/s", "BLIS GF/s");
  for (const Config& c : configs) {
    if (!only.empty() && only != c.name) continue;
    struct Product {
      const char* name;
      int64_t m, n, k;
      bool ta, tb;
    };
    const Product products[] = {
        {"qkv fwd", c.rows, 3 * c.d, c.d, false, true},   {"ff1 fwd", c.rows, c.ff, c.d, false, true},
        {"ff2 fwd", c.rows, c.d, c.ff, false, true},      {"ff1 dx", c.rows, c.d, c.ff, false, false},
        {"ff2 dx", c.rows, c.ff, c.d, false, false},      {"ff1 dW", c.ff, c.d, c.rows, true, false},
        {"ff2 dW", c.d, c.ff, c.rows, true, false},       {"out dW", c.d, c.d, c.rows, true, false},
    };
    for (const Product& p : products) {
      if (!only_product.empty() && only_product != p.name) continue;
      if (c.forward_only && std::string(p.name).find("fwd") == std::string::npos) continue;
      std::vector<float> a(size_t(p.m * p.k), 0.01f), b(size_t(p.k * p.n), 0.02f), out(size_t(p.m * p.n), 0.0f);
      const int64_t lda = p.ta ? p.m : p.k, ldb = p.tb ? p.k : p.n;
      auto ours = [&] {  // mha's kernel as the dispatch calls it (a weight gradient with n > m as its transpose)
        cpu::force_sgemm_backend(cpu::GemmBackend::mha);
        cpu::gemm<float>(p.ta, p.tb, p.m, p.n, p.k, 1.0f, a.data(), lda, b.data(), ldb, 1.0f, out.data(), p.n);
        cpu::force_sgemm_backend(std::nullopt);
      };
      auto blas = [&] {
        cblas_sgemm(CblasRowMajor, p.ta ? CblasTrans : CblasNoTrans, p.tb ? CblasTrans : CblasNoTrans, blasint(p.m),
                    blasint(p.n), blasint(p.k), 1.0f, a.data(), blasint(lda), b.data(), blasint(ldb), 1.0f, out.data(),
                    blasint(p.n));
      };
      const bool openblas_suits = cpu::sgemm_backend() != cpu::GemmBackend::mha;
      auto split = [&] {  // OpenBLAS as the dispatch calls it (also where the dispatch mixes in mha's kernel)
        if (!openblas_suits) return;
        cpu::force_sgemm_backend(cpu::GemmBackend::openblas);
        cpu::gemm<float>(p.ta, p.tb, p.m, p.n, p.k, 1.0f, a.data(), lda, b.data(), ldb, 1.0f, out.data(), p.n);
        cpu::force_sgemm_backend(std::nullopt);
      };
      std::vector<mha::bfloat16> a16(a.size(), mha::bfloat16(0.01f)), b16(b.size(), mha::bfloat16(0.02f));
      auto half = [&] {
        cpu::gemm(p.ta, p.tb, p.m, p.n, p.k, 1.0f, a16.data(), lda, b16.data(), ldb, 1.0f, out.data(), p.n);
      };
      auto blis = [&] {  // row-major: row stride ld, column stride 1 (transposed: swapped)
        if (!blis_sgemm) return;
        const float one = 1.0f;
        blis_sgemm(p.ta ? kBlisTranspose : 0, p.tb ? kBlisTranspose : 0, p.m, p.n, p.k, &one, a.data(), lda, 1,
                   b.data(), ldb, 1, &one, out.data(), p.n, 1);
      };
      ours(), blas(), split(), half(), blis();
      std::vector<double> t_ours, t_blas, t_split, t_half, t_blis;
      for (int r = 0; r < reps; ++r)
        t_ours.push_back(bench::seconds_of(ours)), t_blas.push_back(bench::seconds_of(blas)),
            t_split.push_back(bench::seconds_of(split)), t_half.push_back(bench::seconds_of(half)),
            t_blis.push_back(bench::seconds_of(blis));
      const double flops = 2.0 * double(p.m) * double(p.n) * double(p.k);
      auto rate = [&](std::vector<double>& t) {
        std::sort(t.begin(), t.end());
        return flops / t[t.size() / 2] / 1e9;
      };
      std::printf("%-6s %-12s %6lld %6lld %6lld %3d %3d %10.1f %10.1f %10.1f %10.1f %10.1f\n", c.name, p.name,
                  (long long)p.m, (long long)p.n, (long long)p.k, p.ta, p.tb, rate(t_ours), rate(t_blas),
                  openblas_suits ? rate(t_split) : 0.0, rate(t_half), blis_sgemm ? rate(t_blis) : 0.0);
    }
  }
  return 0;
} catch (const std::exception& e) {
  return mha::bench::failed(argv[0], e);
}
