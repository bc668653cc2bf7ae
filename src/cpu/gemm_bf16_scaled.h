// The scaling around the bfloat16 kernels' products (gemm_bf16_avx512.cpp,
// gemm_bf16_amx.cpp), which compute only C = P or C += P for P = op(A)·op(B).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <new>

namespace mha::cpu {
namespace {  // each kernel's translation unit its own copy, built for its instruction sets

// C = alpha·P + beta·C (C not read for beta = 0) through product(accumulate,
// out, ld), which writes P into out (accumulate false) or adds it: straight
// into C for alpha = 1 and beta 0 or 1 (the layers' products), else P apart
// first. k = 0 makes P = 0.
template <class Product>
void bf16_product_scaled(int64_t m, int64_t n, int64_t k, float alpha, float beta, float* c, int64_t ldc,
                         const Product& product) {
  if (m <= 0 || n <= 0) return;
  if (k == 0) {
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n; ++j) c[r * ldc + j] = beta == 0.0f ? 0.0f : beta * c[r * ldc + j];
    return;
  }
  if (alpha == 1.0f && (beta == 0.0f || beta == 1.0f)) return product(beta == 1.0f, c, ldc);
  const int64_t padded = (m * n + 15) / 16 * 16;
  float* t = static_cast<float*>(std::aligned_alloc(64, size_t(padded) * sizeof(float)));
  if (!t) throw std::bad_alloc();
  product(false, t, n);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j)
      c[r * ldc + j] = beta == 0.0f ? alpha * t[r * n + j] : alpha * t[r * n + j] + beta * c[r * ldc + j];
  std::free(t);
}

}  // namespace
}  // namespace mha::cpu
