// CBLAS wrappers for float and double, and bfloat16 operands with float32 sums.
#include "cpu/gemm.h"

#include <cblas.h>

#include <cstring>
#include <vector>

#include "cpu/flash/dispatch.h"

namespace mha::cpu {

namespace {

CBLAS_TRANSPOSE op(bool t) { return t ? CblasTrans : CblasNoTrans; }

// rows × cols bfloat16 values, rows `ld` apart, widened into a compact
// float32 buffer of this thread (grow-only: no fresh pages in a steady state).
const float* widen(const bfloat16* src, int64_t rows, int64_t cols, int64_t ld, int slot) {
  thread_local std::vector<float> buffers[2];
  std::vector<float>& out = buffers[slot];
  if (out.size() < size_t(rows * cols)) out.resize(size_t(rows * cols));
  float* dst = out.data();
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

template <>
void gemm<float>(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, op(ta), op(tb), blasint(m), blasint(n), blasint(k), alpha, a, blasint(lda), b,
              blasint(ldb), beta, c, blasint(ldc));
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
  static const bool has_bf16 = __builtin_cpu_supports("avx512bf16");
  if (has_bf16 && active_isa() == Isa::avx512) return gemm_bf16_avx512(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  // op(A) is m×k: stored as m rows of k, or (transposed) k rows of m; B likewise.
  const int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
  const float* fa = widen(a, a_rows, a_cols, lda, 0);
  const float* fb = widen(b, b_rows, b_cols, ldb, 1);
  gemm<float>(ta, tb, m, n, k, alpha, fa, a_cols > 0 ? a_cols : 1, fb, b_cols > 0 ? b_cols : 1, beta, c, ldc);
}

void round_to_bf16(const float* src, bfloat16* dst, int64_t n) {
  if (active_isa() == Isa::avx512) return round_to_bf16_avx512(src, dst, n);
  // bfloat16::round_from without the branch, so that the loop vectorises.
  uint16_t* out = &dst->bits;
#pragma omp parallel for schedule(static) if (n > (int64_t(1) << 18))
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &src[i], 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    out[i] = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
  }
}

}  // namespace mha::cpu
