// Dense matrix products through CBLAS (OpenBLAS), row-major:
//   C[m×n] = alpha · op(A) · op(B) + beta · C,  op(X) = X or Xᵀ.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "mha/dtype.h"

namespace mha::cpu {

// Who computes float32 products: mha's own kernel (cpu/sgemm/sgemm.h, on the
// avx512 or avx2 kernels of active_isa(); OpenBLAS on the scalar path) or
// OpenBLAS. mha's when OpenBLAS runs kernels older than the CPU (gemm.cpp),
// else OpenBLAS; MHA_GEMM=mha or MHA_GEMM=openblas in the environment decides
// instead. Chosen once per process, so every run computes the same sums.
enum class GemmBackend { openblas, mha };
GemmBackend sgemm_backend();
// Overrides the choice until called with nullopt (tests: both backends in
// one process). Not for use while products run on other threads.
void force_sgemm_backend(std::optional<GemmBackend> backend);
// The rule behind it: whether OpenBLAS's kernel set `core` (its
// openblas_get_corename()) suits a CPU with AVX2 (`avx2`) whose active
// kernels are AVX-512 on pipes 512 bits wide (`wide_avx512_active`): an
// AVX-512 set always, an AVX2 set (Haswell, Zen) unless the pipes are wide,
// anything older never. Without AVX2 OpenBLAS is the only choice.
bool openblas_suits(const std::string& core, bool avx2, bool wide_avx512_active);

template <class T>
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

// The same with bfloat16 A and B and float32 C (cblas_sbgemm's contract): a
// product of two bfloat16 numbers is exact in float32, and the sums are
// float32. Debian's OpenBLAS 0.3.21 declares cblas_sbgemm but is built
// without it, so: gemm_bf16_avx512 where bf16_dot_products_pay() (and the
// avx512 kernels are active, see cpu/flash/dispatch.h); elsewhere the
// operands are widened to float32 (exactly) and go through the float32
// product. Both give the same numbers up to the order of the float32 sums.
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const bfloat16* a,
          int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c, int64_t ldc);

// C = op(A)·op(B) + bias: the n values of bias added to every row of C (a
// null bias adds 0; C is not read). A may be T, or bfloat16 with T float.
// On OpenBLAS each thread writes the bias into its own part of C just before
// its part of the product, instead of a pass over C on one thread first.
template <class T, class A>
void gemm_bias(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const A* a, int64_t lda,
               const A* b, int64_t ldb, const T* bias, T* c, int64_t ldc);

// Whether vdpbf16ps outruns float32 FMAs here, so that bfloat16 products pay:
// on AMD's Zen 4 and later (two products per lane per instruction on the same
// pipes: twice the FP32 rate); not on Intel's Xeons up to the 5th generation,
// where it runs at half the AVX-512 FMA rate (measured on family 6 model 207:
// 170 vs 345 GFLOP/s on 2 cores; their fast bfloat16 unit is AMX). CPUs with
// AVX512-BF16, by vendor; MHA_BF16_GEMM=dot or MHA_BF16_GEMM=widen in the
// environment decides instead. Chosen once per process; the bfloat16
// attention kernels (cpu/flash) follow it too.
bool bf16_dot_products_pay();
// Tests: decide it for later calls (nullopt: back to the CPU's answer).
// Throws DeviceError to turn it on without AVX512-BF16.
void force_bf16_dot_products(std::optional<bool> on);

// The AVX512-BF16 kernel of the above (gemm_bf16_avx512.cpp). Needs
// AVX512-BF16; treats bfloat16 denormals as zero.
void gemm_bf16_avx512(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
                      const bfloat16* a, int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c, int64_t ldc);

// out[j] = the pair (even[j], odd[j]) as one word, even[j] in its low half,
// for j < n (odd null: 0 in every high half): two rows of bfloat16 regrouped
// in pairs along them, as vdpbf16ps takes a row-major operand
// (gemm_bf16_avx512.cpp; needs the avx512 kernels' instruction sets).
void interleave_pairs_avx512(const uint16_t* even, const uint16_t* odd, int64_t n, uint32_t* out);

// dst[i] = src[i] rounded to bfloat16 (nearest even; NaN stays NaN; denormals kept).
void round_to_bf16(const float* src, bfloat16* dst, int64_t n);
// The same with AVX-512 (gemm_bf16_avx512.cpp; needs the avx512 kernels' instruction sets).
void round_to_bf16_avx512(const float* src, bfloat16* dst, int64_t n);

}  // namespace mha::cpu
