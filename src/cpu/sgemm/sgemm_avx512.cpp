// mha's float32 matrix product built for avx512 (see sgemm_kernel.h).
#define MHA_SIMD_AVX512 1
#define MHA_ISA_NAMESPACE avx512
#include "cpu/sgemm/sgemm_kernel.h"

namespace mha::cpu {

void sgemm_avx512(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                const float* b, int64_t ldb, float beta, float* c, int64_t ldc, const float* bias) {
  avx512::sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, bias);
}

}  // namespace mha::cpu
