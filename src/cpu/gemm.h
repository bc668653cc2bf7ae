// Dense matrix products through CBLAS (OpenBLAS), row-major:
//   C[m×n] = alpha · op(A) · op(B) + beta · C,  op(X) = X or Xᵀ.
#pragma once

#include <cstdint>

namespace mha::cpu {

template <class T>
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

}  // namespace mha::cpu
