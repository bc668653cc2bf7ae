// mha's own float32 matrix product, C = alpha·op(A)·op(B) + beta·C (+ bias,
// n floats added to every row, when not null) (row-major),
// on the fused attention kernels' register micro-tiles (cpu/flash/micro_tile.h),
// built for AVX-512 and AVX2+FMA. cpu::gemm<float> (gemm.cpp) chooses it or
// OpenBLAS by the rule in gemm.cpp.
#pragma once

#include <cstdint>

namespace mha::cpu {

// A product of at most this many rows against a transposed B (op(A)·Wᵀ, a
// Linear layer's decoding step) goes by dot products along k, reading W
// once and packing nothing (sgemm_kernel.h's skinny path); gemm<float>
// sends such products here under every backend.
inline constexpr int64_t kSkinnyRows = 16;

void sgemm_avx512(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                  int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc, const float* bias = nullptr);
void sgemm_avx2(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc, const float* bias = nullptr);

}  // namespace mha::cpu
