// CBLAS wrappers for float and double, and bfloat16 operands with float32 sums;
// float32 products go to mha's own kernel (cpu/sgemm) or OpenBLAS by the
// rule of sgemm_backend().
#include "cpu/gemm.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>

#include "check.h"
#include "cpu/flash/dispatch.h"
#include "cpu/fma_rate.h"
#include "cpu/scratch.h"
#include "cpu/sgemm/sgemm.h"
#include "cpu/transpose.h"
#include "mha/errors.h"

namespace mha::cpu {

namespace {

CBLAS_TRANSPOSE op(bool t) { return t ? CblasTrans : CblasNoTrans; }

// rows × cols bfloat16 values, rows `ld` apart, widened into a compact
// float32 buffer of this thread (grow-only: no fresh pages in a steady state).
const float* widen(const bfloat16* src, int64_t rows, int64_t cols, int64_t ld, ScratchSlot slot) {
  float* dst = static_cast<float*>(thread_scratch_bytes(slot, rows * cols * int64_t(sizeof(float))));
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* s = &src[r * ld].bits;
    float* d = dst + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t u = uint32_t(s[c]) << 16;
      std::memcpy(&d[c], &u, 4);
    }
  }
  return dst;
}

}  // namespace

// OpenBLAS's DYNAMIC_ARCH build picks a kernel set from the CPU model; a
// model newer than the build falls back to an older set: "Prescott", SSE3
// code at a sixth of the AVX-512 rate (0.3.21 on a 5th-generation Xeon: 51
// vs 300 GFLOP/s at 2048³ on 2 cores, measured), or "Haswell", 256-bit code
// (0.3.21 on AMD Zen 5, family 26). The AVX2 sets match a core whose
// 512-bit FMAs run no faster than two 256-bit ones (Zen 4: OpenBLAS's Zen
// set sustains ~86% of peak there, sgemm 2048³ on 2 cores), not one whose
// pipes are 512 bits wide: on the 2-core Zen 5, OpenBLAS's Haswell set ran
// the training shapes at 160-200 GFLOP/s, mha's AVX-512 kernel at 200-360
// (bench_gemm, 512-bit peak ~450).
GemmBackend sgemm_backend_for(const std::string& core, bool avx2, bool avx512_active, bool wide_pipes) {
  if (!avx2) return GemmBackend::openblas;
  for (const char* avx512_core : {"SkylakeX", "Cooperlake", "SapphireRapids"})
    if (core == avx512_core) return avx512_active ? GemmBackend::mixed : GemmBackend::openblas;
  for (const char* avx2_core : {"Haswell", "Zen"})
    if (core == avx2_core) return avx512_active && wide_pipes ? GemmBackend::mha : GemmBackend::openblas;
  return GemmBackend::mha;
}

namespace {

// OpenBLAS's thread count while any product of mha's is in flight: 1, so
// that OpenMP's team is the only one running; restored when the last one
// ends, for other users of the library (PyTorch in the same process). One
// count for the process under a lock: products run from several threads at
// once (inside parallel regions), and a thread that put the old count back
// while another's call was in flight sent that call to OpenBLAS's pool from
// two threads at once (a crash, seen under ctest -j2). OpenBLAS 0.3.21 also
// sets the calling thread's OpenMP thread count when told its own
// (measured: omp_get_max_threads() read 1 after openblas_set_num_threads(1)),
// so each caller puts its own back.
class OneBlasThread {
 public:
  OneBlasThread() {
    const std::lock_guard<std::mutex> lock(state().mutex);
    if (state().users++ == 0) {
      state().saved = openblas_get_num_threads();
      set(1);
    }
  }
  ~OneBlasThread() {
    const std::lock_guard<std::mutex> lock(state().mutex);
    if (--state().users == 0) set(state().saved);
  }
  OneBlasThread(const OneBlasThread&) = delete;
  OneBlasThread& operator=(const OneBlasThread&) = delete;

 private:
  struct State {
    std::mutex mutex;
    int users = 0, saved = 1;
  };
  static State& state() {
    static State s;
    return s;
  }
  static void set(int threads) {
    if (openblas_get_num_threads() == threads) return;
    const int omp = omp_get_max_threads();
    openblas_set_num_threads(threads);
    if (omp_get_max_threads() != omp) omp_set_num_threads(omp);
  }
};

// C rows [r0, r0 + rows), columns [c0, c0 + cols) = bias[c0 …] (or 0).
template <class T>
void fill_with_bias(T* c, int64_t ldc, int64_t r0, int64_t rows, int64_t c0, int64_t cols, const T* bias) {
  for (int64_t r = r0; r < r0 + rows; ++r) {
    if (bias) std::memcpy(c + r * ldc + c0, bias + c0, size_t(cols) * sizeof(T));
    else std::fill(c + r * ldc + c0, c + r * ldc + c0 + cols, T(0));
  }
}

// C = α·op(A)·op(B) + β·C on OpenBLAS, its rows (or columns, whichever are
// more) split over OpenMP's threads, each part one single-threaded call.
// OpenBLAS's own pool beside OpenMP's made two teams take turns on the
// cores: OpenMP's idle thread spun through every product while OpenBLAS's
// worker wanted its core, and OpenBLAS's idle worker yielded in a loop
// through every layer kernel (the small training step spent 19% of its
// cycles in libgomp's spin; with OPENBLAS_NUM_THREADS=1 it already ran 1.06×
// faster). Parts are whole multiples of 16 rows or columns, so each is its
// micro-kernel's full tiles but the last. Inside a parallel region the
// caller's thread takes the product alone. With a bias (β then 1), each
// thread writes it into its part of C just before its product.
void openblas_sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                    const float* b, int64_t ldb, float beta, float* c, int64_t ldc, const float* bias = nullptr) {
  const auto call = [&](int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
    if (bias) fill_with_bias(c, ldc, r0, rows, c0, cols, bias);
    cblas_sgemm(CblasRowMajor, op(ta), op(tb), blasint(rows), blasint(cols), blasint(k), alpha,
                a + (ta ? r0 : r0 * lda), blasint(lda), b + (tb ? c0 * ldb : c0), blasint(ldb), bias ? 1.0f : beta,
                c + r0 * ldc + c0, blasint(ldc));
  };
  const OneBlasThread one;
  const int64_t threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const bool by_rows = m >= n;
  const int64_t extent = by_rows ? m : n, parts = std::min<int64_t>(threads, extent / 16);
  if (parts <= 1 || m * n * k < (int64_t(1) << 18)) return call(0, m, 0, n);
  const int64_t step = ((extent + parts - 1) / parts + 15) / 16 * 16;
#pragma omp parallel for schedule(static, 1) num_threads(int(parts))
  for (int64_t part = 0; part < parts; ++part) {
    const int64_t first = part * step, count = std::min(step, extent - first);
    if (count <= 0) continue;
    if (by_rows) call(first, count, 0, n);
    else call(0, m, first, count);
  }
}

}  // namespace

std::string to_string(Bf16Products kind) {
  switch (kind) {
    case Bf16Products::dot: return "dot";
    case Bf16Products::amx: return "amx";
    case Bf16Products::widen: break;
  }
  return "widen";
}

std::vector<Bf16Products> supported_bf16_products() {
  std::vector<Bf16Products> out{Bf16Products::widen};
  const bool avx512 = supported_isas().back() == Isa::avx512;  // the kernels' other instruction sets
  if (avx512 && __builtin_cpu_supports("avx512bf16")) out.push_back(Bf16Products::dot);
  if (avx512 && amx_bf16_usable()) out.push_back(Bf16Products::amx);
  return out;
}

namespace {
std::optional<Bf16Products>& forced_bf16_products() {
  static std::optional<Bf16Products> forced;
  return forced;
}
}  // namespace

Bf16Products bf16_products() {
  static const Bf16Products by_cpu = [] {
    const std::vector<Bf16Products> kinds = supported_bf16_products();
    if (const char* env = std::getenv("MHA_BF16_GEMM"))
      for (Bf16Products kind : kinds)
        if (to_string(kind) == env) return kind;
    if (kinds.back() == Bf16Products::amx) return Bf16Products::amx;
    if (kinds.back() == Bf16Products::dot && __builtin_cpu_is("amd")) return Bf16Products::dot;
    return Bf16Products::widen;
  }();
  const std::optional<Bf16Products>& forced = forced_bf16_products();
  return forced ? *forced : by_cpu;
}

void force_bf16_products(std::optional<Bf16Products> kind) {
  if (kind) {
    const std::vector<Bf16Products> kinds = supported_bf16_products();
    if (std::find(kinds.begin(), kinds.end(), *kind) == kinds.end())
      raise<DeviceError>("mha::cpu::force_bf16_products", "kind", "a kind of bfloat16 product this CPU runs",
                         to_string(*kind));
  }
  forced_bf16_products() = kind;
}

namespace {
std::optional<GemmBackend>& forced_sgemm_backend() {
  static std::optional<GemmBackend> forced;
  return forced;
}
}  // namespace

void force_sgemm_backend(std::optional<GemmBackend> backend) { forced_sgemm_backend() = backend; }

std::string to_string(GemmBackend backend) {
  switch (backend) {
    case GemmBackend::openblas: return "openblas";
    case GemmBackend::mha: return "mha";
    case GemmBackend::mixed: break;
  }
  return "mixed";
}

// Where OpenBLAS runs its AVX-512 kernels and mha's are AVX-512 too: mixed
// (decided by names, not by timing, so that a run and its resumption choose
// alike). mha's kernel adds the bias in its first accumulators and
// writes C once; OpenBLAS's sgemm zeroes C (or mha fills it with the bias)
// and then adds the product into it, a second pass over an output of up to
// 16 MiB at the long shape. Measured on a 2-vCPU AVX-512 Xeon, training
// tokens/s, three alternating rounds against OpenBLAS for every product:
// small +4%, mid +4.5%, long +3%, wide even; on a 2-vCPU Zen 4 (OpenBLAS's
// Cooperlake set, 512-bit FMAs at the 256-bit rate), eight rounds, medians:
// small 162k -> 166k, mid 7218 -> 7480, long and wide even (five and three
// rounds, inside the VM's noise). Weight gradients (A transposed,
// k = the batch's tokens) stay on OpenBLAS, ahead there (bench_gemm). On AVX2
// code OpenBLAS's Haswell kernels are ahead of mha's 6 × 2-vector micro-tile
// and the mix measured even (long +0.6%, mid +0.3%): OpenBLAS.
GemmBackend sgemm_backend() {
  if (const std::optional<GemmBackend>& forced = forced_sgemm_backend()) return *forced;
  static const GemmBackend chosen = [] {
    if (const char* env = std::getenv("MHA_GEMM"))
      for (GemmBackend b : {GemmBackend::openblas, GemmBackend::mha, GemmBackend::mixed})
        if (to_string(b) == env) return b;
    const bool avx512 = active_isa() == Isa::avx512;
    return sgemm_backend_for(openblas_get_corename(), __builtin_cpu_supports("avx2"), avx512,
                             avx512 && avx512_doubles_fma_rate());
  }();
  return chosen;
}

namespace {

// A weight gradient C = Aᵀ·B (A k × m, B k × n, k the batch's tokens) with
// more columns than rows, on mha's kernels, computed as its transpose
// Cᵀ = Bᵀ·A into scratch and added to C transposed: `product(tm, tn, ta_, tb_,
// a_, lda_, b_, ldb_, t, ldt)` runs the kernel. Both kernels (cpu/sgemm,
// gemm_bf16_avx512) pack all of op(B) before the product, k × n of it, and
// read it back from beyond L2, while op(A) is packed tile by tile next to
// its use: with B the larger operand (ff2's weight gradient, 256 × 1024 ×
// 2096: B 8 MiB, A 2 MiB) that costs more than the pass over Cᵀ (1 MiB) that
// the transpose adds. ff1's gradient, 1024 × 256 × 2096, ran at 317 GFLOP/s
// and ff2's at 262 (bench_gemm, Zen 5, 2 threads). With fewer than 128 rows
// the transpose has too few columns to share each packed tile of Bᵀ among
// (64 × 256 × 1376: 4-11% slower that way). False: not such a product
// (alpha ≠ 1, beta other than 0 or 1, k within one depth block of 256).
template <class Product>
bool as_transpose(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, float beta, float* c, int64_t ldc,
                  Product&& product) {
  if (!ta || tb || n <= m || m < 128 || k <= 256 || alpha != 1.0f || (beta != 0.0f && beta != 1.0f)) return false;
  float* t = static_cast<float*>(thread_scratch_bytes(ScratchSlot::gemm_t, n * m * int64_t(sizeof(float))));
  product(t);  // Cᵀ, n × m, row stride m
  // C (+)= Tᵀ in 16 × 16 blocks: a block's 16 rows of T (16 lines) are read
  // across while 16 rows of C are written down, 4 × 4 at a time in registers.
  constexpr int64_t kBlock = 16;
  const int64_t blocks = (m + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (m * n >= (int64_t(1) << 15) && !omp_in_parallel())
  for (int64_t ib = 0; ib < blocks; ++ib) {
    const int64_t i0 = ib * kBlock, i1 = std::min(m, i0 + kBlock);
    for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
      const int64_t j1 = std::min(n, j0 + kBlock);
      const float* from = t + j0 * m + i0;
      float* to = c + i0 * ldc + j0;
      if (beta == 0.0f) transpose_block<false>(from, m, j1 - j0, i1 - i0, to, ldc);
      else transpose_block<true>(from, m, j1 - j0, i1 - i0, to, ldc);
    }
  }
  return true;
}

// The product on mha's kernel when the backend gives it this one, or it is
// skinny (a decoding step's), and the active instruction set has it
// (AVX-512, AVX2); false: the caller's to do. OpenBLAS packs all of W for a
// product of a few rows, as it would for thousands: on a 2-vCPU Zen 3 (its
// Zen set), packing took 18% of greedy decoding at mid, the product 36%.
bool mha_sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc, const float* bias = nullptr) {
  const GemmBackend backend = sgemm_backend();
  const bool skinny = !ta && tb && m <= kSkinnyRows && k > 0;
  if (!skinny && (backend == GemmBackend::openblas || (backend == GemmBackend::mixed && ta))) return false;
  const Isa isa = active_isa();
  if (isa != Isa::avx512 && isa != Isa::avx2) return false;
  const auto kernel = isa == Isa::avx512 ? &sgemm_avx512 : &sgemm_avx2;
  if (!bias && as_transpose(ta, tb, m, n, k, alpha, beta, c, ldc, [&](float* t) {
        kernel(true, false, n, m, k, 1.0f, b, ldb, a, lda, 0.0f, t, m, nullptr);
      }))
    return true;
  kernel(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, bias);
  return true;
}
}  // namespace

template <>
void gemm<float>(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (mha_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) return;
  openblas_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

template <>
void gemm<double>(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
                  int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_dgemm(CblasRowMajor, op(ta), op(tb), blasint(m), blasint(n), blasint(k), alpha, a, blasint(lda), b,
              blasint(ldb), beta, c, blasint(ldc));
}

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const bfloat16* a, int64_t lda,
          const bfloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (active_isa() == Isa::avx512) {
    const Bf16Products kind = bf16_products();
    const bool decoding = !ta && tb && m <= kBf16SkinnyRows;  // see gemm_bf16_avx512
    if (kind == Bf16Products::amx && !decoding) return gemm_bf16_amx(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    if (kind == Bf16Products::dot && as_transpose(ta, tb, m, n, k, alpha, beta, c, ldc, [&](float* t) {
          gemm_bf16_avx512(true, false, n, m, k, 1.0f, b, ldb, a, lda, 0.0f, t, m);
        }))
      return;
    if (kind != Bf16Products::widen) return gemm_bf16_avx512(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  // op(A) is m×k: stored as m rows of k, or (transposed) k rows of m; B likewise.
  const int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
  const float* fa = widen(a, a_rows, a_cols, lda, ScratchSlot::widen_a);
  const float* fb = widen(b, b_rows, b_cols, ldb, ScratchSlot::widen_b);
  gemm<float>(ta, tb, m, n, k, alpha, fa, a_cols > 0 ? a_cols : 1, fb, b_cols > 0 ? b_cols : 1, beta, c, ldc);
}

template <class T, class A>
void gemm_bias(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const A* a, int64_t lda, const A* b, int64_t ldb,
               const T* bias, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k > 0 && !bias) return gemm(ta, tb, m, n, k, T(1), a, lda, b, ldb, T(0), c, ldc);
  if constexpr (std::is_same_v<T, float> && std::is_same_v<A, float>) {
    if (mha_sgemm(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc, bias)) return;
    if (k > 0) return openblas_sgemm(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc, bias);
  }
  if constexpr (std::is_same_v<A, bfloat16>) {  // the dot kernel adds the bias as it stores
    if (k > 0 && active_isa() == Isa::avx512 && bf16_products() == Bf16Products::dot)
      return gemm_bf16_avx512(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc, bias);
  }
#pragma omp parallel for schedule(static) if (m * n >= (int64_t(1) << 15) && !omp_in_parallel())
  for (int64_t r = 0; r < m; ++r) fill_with_bias(c, ldc, r, 1, 0, n, bias);
  if (k > 0) gemm(ta, tb, m, n, k, T(1), a, lda, b, ldb, T(1), c, ldc);
}

template void gemm_bias<float, float>(bool, bool, int64_t, int64_t, int64_t, const float*, int64_t, const float*,
                                      int64_t, const float*, float*, int64_t);
template void gemm_bias<double, double>(bool, bool, int64_t, int64_t, int64_t, const double*, int64_t, const double*,
                                        int64_t, const double*, double*, int64_t);
template void gemm_bias<float, bfloat16>(bool, bool, int64_t, int64_t, int64_t, const bfloat16*, int64_t,
                                         const bfloat16*, int64_t, const float*, float*, int64_t);

}  // namespace mha::cpu
