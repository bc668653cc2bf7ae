// Dense matrix products through CBLAS (OpenBLAS), row-major:
//   C[m×n] = alpha · op(A) · op(B) + beta · C,  op(X) = X or Xᵀ.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mha/dtype.h"

namespace mha::cpu {

// Who computes float32 products: mha's own kernel (cpu/sgemm/sgemm.h, on the
// avx512 or avx2 kernels of active_isa(); OpenBLAS on the scalar path),
// OpenBLAS, or mixed: mha's kernel where op(A) is A (forward products and
// input gradients, bias fused), OpenBLAS where it is Aᵀ (weight gradients).
// mha's when OpenBLAS runs kernels older than the CPU, mixed where both
// OpenBLAS's kernels and the active ones are AVX-512, else OpenBLAS (gemm.cpp
// has the measurements); MHA_GEMM=mha|openblas|mixed in the environment
// decides instead. Chosen once per process, so every run computes the same sums.
// Under every backend, a product of at most kSkinnyRows rows against a
// transposed B (decoding) is mha's on AVX-512 and AVX2 (cpu/sgemm/sgemm.h).
enum class GemmBackend { openblas, mha, mixed };
GemmBackend sgemm_backend();
std::string to_string(GemmBackend backend);
// Overrides the choice until called with nullopt (tests: both backends in
// one process). Not for use while products run on other threads.
void force_sgemm_backend(std::optional<GemmBackend> backend);
// The rule behind it, from OpenBLAS's kernel set `core` (its
// openblas_get_corename()), whether the CPU has AVX2, whether mha's active
// kernels are AVX-512 and whether their pipes are 512 bits wide (it decides
// only for an AVX2 set): an AVX-512 set mixed under AVX-512 kernels, else
// OpenBLAS; an AVX2 set (Haswell, Zen) OpenBLAS unless AVX-512 runs on wide
// pipes (then mha); anything older mha. Without AVX2, OpenBLAS.
GemmBackend sgemm_backend_for(const std::string& core, bool avx2, bool avx512_active, bool wide_pipes);

template <class T>
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

// The same with bfloat16 A and B and float32 C (cblas_sbgemm's contract): a
// product of two bfloat16 numbers is exact in float32, and the sums are
// float32. Debian's OpenBLAS 0.3.21 declares cblas_sbgemm but is built
// without it, so mha runs it on the kernel of bf16_products() where the
// avx512 kernels are active (cpu/flash/dispatch.h), else on widened operands.
// Every kernel gives the same numbers up to the order of the float32 sums.
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, const bfloat16* a,
          int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c, int64_t ldc);

// C = op(A)·op(B) + bias: the n values of bias added to every row of C (a
// null bias adds 0; C is not read). A may be T, or bfloat16 with T float.
// On OpenBLAS each thread writes the bias into its own part of C just before
// its part of the product, instead of a pass over C on one thread first.
template <class T, class A>
void gemm_bias(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const A* a, int64_t lda,
               const A* b, int64_t ldb, const T* bias, T* c, int64_t ldc);

// How bfloat16 products run:
//   widen  operands widened to float32 (exactly), float32 products;
//   dot    AVX512-BF16 dot products (vdpbf16ps, gemm_bf16_avx512): they pay
//          on AMD's Zen 4 and later (two products per lane per instruction
//          on the FMA pipes: twice the FP32 rate), not on Intel's Xeons, where
//          vdpbf16ps runs at half the AVX-512 FMA rate (measured on family 6
//          model 207: 170 vs 345 GFLOP/s on 2 cores);
//   amx    AMX tiles (TDPBF16PS, gemm_bf16_amx): Intel's Xeons from the 4th
//          generation, 16 times the FP32 FMA rate a cycle.
// Chosen once per process: amx where the CPU and the system grant it, else
// dot on AMD CPUs with AVX512-BF16, else widen; MHA_BF16_GEMM=widen, dot or
// amx in the environment decides instead (where supported). The bfloat16
// attention kernels (cpu/flash) use vdpbf16ps where the choice is dot.
enum class Bf16Products { widen, dot, amx };
Bf16Products bf16_products();
// The kinds this CPU can run (widen always), and their names.
std::vector<Bf16Products> supported_bf16_products();
std::string to_string(Bf16Products kind);
// Tests: decide it for later calls (nullopt: back to the CPU's answer).
// Throws DeviceError for a kind the CPU cannot run.
void force_bf16_products(std::optional<Bf16Products> kind);

// The AVX512-BF16 kernel (gemm_bf16_avx512.cpp). Needs AVX512-BF16; treats
// bfloat16 denormals as zero. A product of at most kBf16SkinnyRows rows
// against a transposed B (a Linear layer's decoding step) goes by dot
// products along k, reading B once without packing it (AMX would pack all
// of B first, so gemm sends such products here too).
inline constexpr int64_t kBf16SkinnyRows = 16;
// With bias (n, along every row; only with alpha 1, beta 0 and k > 0):
// C = op(A)·op(B) + bias, the bias added as the results are stored.
void gemm_bf16_avx512(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
                      const bfloat16* a, int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c, int64_t ldc,
                      const float* bias = nullptr);
// The AMX kernel (gemm_bf16_amx.cpp). Needs amx_bf16_usable(); treats
// bfloat16 denormals as zero.
void gemm_bf16_amx(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
                   const bfloat16* a, int64_t lda, const bfloat16* b, int64_t ldb, float beta, float* c, int64_t ldc);
// Whether the CPU has AMX-TILE, AMX-BF16 and AVX512-BF16 and the system has
// granted this process the tiles' state (asked once, at the first call).
bool amx_bf16_usable();

// out[j] = the pair (even[j], odd[j]) as one word, even[j] in its low half,
// for j < n (odd null: 0 in every high half): two rows of bfloat16 regrouped
// in pairs along them, as vdpbf16ps takes a row-major operand
// (gemm_bf16_avx512.cpp; needs the avx512 kernels' instruction sets).
void interleave_pairs_avx512(const uint16_t* even, const uint16_t* odd, int64_t n, uint32_t* out);

}  // namespace mha::cpu
