// CBLAS wrappers for float and double.
#include "cpu/gemm.h"

#include <cblas.h>

namespace mha::cpu {

namespace {
CBLAS_TRANSPOSE op(bool t) { return t ? CblasTrans : CblasNoTrans; }
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

}  // namespace mha::cpu
