// The float32 product of sgemm.h for one instruction set (included by
// sgemm_avx512.cpp and sgemm_avx2.cpp after defining it), blocked as in
// Goto & van de Geijn (2008):
//
//   op(B) (k × n) packed into panels of kPanel columns (two vectors), each
//         panel k rows of kPanel contiguous floats, zero-padded past n
//   op(A) read in place: element (r, k) at A[r·ar + k·ak] (ar = lda, ak = 1,
//         or transposed ar = 1, ak = lda), broadcast one scalar at a time
//   C     tiles of kRows × kCols, summed over K blocks of kDepth into a float
//         scratch of the thread, then C = alpha·tile + beta·C (C is not read
//         when beta = 0)
//
// For each K block and panel, the panel's kDepth × kPanel block (24 KiB with
// AVX-512: half of L1) stays in L1 while every kGemmRows-row micro-tile of
// the tile passes over it, its A rows coming from L2 (kRows × kDepth, 72
// KiB). The micro-tile, 12 rows × 2 vectors with AVX-512 (24 of 32
// registers accumulate), loads 2 vectors of B per 24 FMAs.
#include <omp.h>

#include <cstdlib>
#include <new>

#include "cpu/flash/kernel.h"
#include "cpu/sgemm/sgemm.h"

namespace mha::cpu::MHA_ISA_NAMESPACE {

namespace sgemm_detail {

#if defined(MHA_SIMD_AVX512)
constexpr int kGemmRows = 12;
#else
constexpr int kGemmRows = kMR;
#endif
constexpr int64_t kPanel = kNV * W;
constexpr int64_t kRows = 96, kCols = 128, kDepth = 192;
static_assert(kCols % kPanel == 0 && kRows % kGemmRows == 0);

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Grow-only scratch of the calling thread, freed when it exits. (No std::
// containers here: their inline code built for this instruction set must not
// be what the linker keeps for the rest of the library.)
struct Scratch {
  float* data[2] = {nullptr, nullptr};
  int64_t floats[2] = {0, 0};
  ~Scratch() {
    std::free(data[0]);
    std::free(data[1]);
  }
  float* get(int slot, int64_t n) {
    if (floats[slot] < n) {
      std::free(data[slot]);
      data[slot] = static_cast<float*>(std::aligned_alloc(64, size_t(round_up(n, 16)) * sizeof(float)));
      if (!data[slot]) throw std::bad_alloc();
      floats[slot] = n;
    }
    return data[slot];
  }
};

inline float* scratch(int slot, int64_t floats) {
  thread_local Scratch s;
  return s.get(slot, floats);
}


// C (rows × kPanel, row stride ldc) (+)= A (rows × depth) · P (depth × kPanel, packed).
template <bool ACC>
inline void panel_product(int64_t rows, int64_t depth, const float* A, int64_t ar, int64_t ak, const float* P, float* C,
                          int64_t ldc) {
  int64_t r = 0;
  for (; r + kGemmRows <= rows; r += kGemmRows)
    micro<kGemmRows, kNV, ACC>(A + r * ar, ar, ak, P, kPanel, C + r * ldc, ldc, depth);
  for (; r < rows; r += kMR) micro_rows<kNV, ACC>(min64(kMR, rows - r), A + r * ar, ar, ak, P, kPanel, C + r * ldc, ldc, depth);
}

}  // namespace sgemm_detail

inline void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                  const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  using namespace sgemm_detail;
  if (m <= 0 || n <= 0) return;
  const int64_t panels = (n + kPanel - 1) / kPanel, n_pad = panels * kPanel;
  // Panel p holds columns [p·kPanel, (p+1)·kPanel) of op(B): row kk at packed + (p·k + kk)·kPanel.
  float* packed = scratch(0, k * n_pad);
#pragma omp parallel for schedule(static) if (k * n_pad > (int64_t(1) << 16))
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t j0 = p * kPanel, width = min64(kPanel, n - j0);
    for (int64_t kk = 0; kk < k; ++kk) {
      float* row = packed + (p * k + kk) * kPanel;
      if (tb)
        for (int64_t j = 0; j < width; ++j) row[j] = b[(j0 + j) * ldb + kk];
      else
        for (int64_t j = 0; j < width; ++j) row[j] = b[kk * ldb + j0 + j];
      for (int64_t j = width; j < kPanel; ++j) row[j] = 0.0f;
    }
  }
  const int64_t ar = ta ? 1 : lda, ak = ta ? lda : 1;
  const int64_t row_tiles = (m + kRows - 1) / kRows, col_tiles = (n_pad + kCols - 1) / kCols;
#pragma omp parallel for schedule(dynamic, 1) if (m * n * k > (int64_t(1) << 17) && row_tiles * col_tiles > 1)
  for (int64_t item = 0; item < row_tiles * col_tiles; ++item) {
    const int64_t r0 = item / col_tiles * kRows, c0 = item % col_tiles * kCols;
    const int64_t rows = min64(kRows, m - r0), cols = min64(kCols, n_pad - c0), width = min64(cols, n - c0);
    float* tile = scratch(1, kRows * kCols);
    if (k == 0)
      for (int64_t x = 0; x < kRows * kCols; ++x) tile[x] = 0.0f;
    for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
      const int64_t depth = min64(kDepth, k - k0);
      const float* a0 = a + r0 * ar + k0 * ak;
      for (int64_t j = 0; j < cols; j += kPanel) {
        const float* panel = packed + ((c0 + j) / kPanel * k + k0) * kPanel;
        if (k0 == 0) panel_product<false>(rows, depth, a0, ar, ak, panel, tile + j, kCols);
        else panel_product<true>(rows, depth, a0, ar, ak, panel, tile + j, kCols);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* out = c + (r0 + r) * ldc + c0;
      const float* t = tile + r * kCols;
      if (beta == 0.0f)
        for (int64_t j = 0; j < width; ++j) out[j] = alpha * t[j];
      else if (alpha == 1.0f && beta == 1.0f)
        for (int64_t j = 0; j < width; ++j) out[j] += t[j];
      else
        for (int64_t j = 0; j < width; ++j) out[j] = alpha * t[j] + beta * out[j];
    }
  }
}

}  // namespace mha::cpu::MHA_ISA_NAMESPACE
