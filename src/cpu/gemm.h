// Dense matrix products through CBLAS (OpenBLAS), row-major:
//   C[m×n] = alpha · op(A) · op(B) + beta · C,  op(X) = X or Xᵀ.
#pragma once

#include <cstdint>

#include "mha/dtype.h"

namespace mha::cpu {

// Who computes float32 products: mha's own kernel (cpu/sgemm/sgemm.h, on the
// avx512 or avx2 kernels of active_isa(); OpenBLAS on the scalar path) or
// OpenBLAS. mha's when OpenBLAS runs kernels older than the CPU (gemm.cpp),
// else OpenBLAS; MHA_GEMM=mha or MHA_GEMM=openblas in the environment decides
// instead. Chosen once per process, so every run computes the same sums.
enum class GemmBackend { openblas, mha };
GemmBackend sgemm_backend();

template <class T>
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

// The same with bfloat16 A and B and float32 C (cblas_sbgemm's contract): a
// product of two bfloat16 numbers is exact in float32, and the sums are
// float32. Debian's OpenBLAS 0.3.21 declares cblas_sbgemm but is built
// without it, so: with AVX512-BF16 (and the avx512 kernels active, see
// cpu/flash/dispatch.h) gemm_bf16_avx512; elsewhere the operands are widened
// to float32 (exactly) and go through sgemm. Both give the same numbers up to
// the order of the float32 sums.
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const bfloat16* a,
          int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c, int64_t ldc);

// The AVX512-BF16 kernel of the above (gemm_bf16_avx512.cpp). Needs
// AVX512-BF16; treats bfloat16 denormals as zero.
void gemm_bf16_avx512(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
                      const bfloat16* a, int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c, int64_t ldc);

// dst[i] = src[i] rounded to bfloat16 (nearest even; NaN stays NaN; denormals kept).
void round_to_bf16(const float* src, bfloat16* dst, int64_t n);
// The same with AVX-512 (gemm_bf16_avx512.cpp; needs the avx512 kernels' instruction sets).
void round_to_bf16_avx512(const float* src, bfloat16* dst, int64_t n);

}  // namespace mha::cpu
