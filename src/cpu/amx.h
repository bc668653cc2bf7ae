// AMX tile helpers shared by the bfloat16 product (gemm_bf16_amx.cpp) and
// the bfloat16 attention kernels (flash/kernel_amx.cpp); only translation
// units built with -mamx-tile -mamx-bf16 include it.
//
// A tile register is 16 rows of 64 bytes. TDPBF16PS C += A·B takes
//   A: 16 rows × 16 pairs along k (32 bfloat16 a row),
//   B: 16 pair rows × 16 columns, word (q, j) = (B[2q][j], B[2q+1][j]),
//   C: 16 × 16 float32,
// 16·16·32 multiply-adds in one instruction, issued every 16 cycles: 1024
// FLOP a cycle against the 64 of two 512-bit float32 FMAs. It treats
// bfloat16 denormals as zero and flushes denormal results, as vdpbf16ps.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace mha::cpu {
namespace {  // each including translation unit its own copy

constexpr int64_t kAmxTile = 16;  // rows of a tile; float32 columns of a C tile; pairs of an A row

// Every kernel's configuration: eight tiles of 16 rows × 64 bytes (palette
// 1). Tiles 0-3 accumulate C(r, c) at 2r + c, 4-5 hold A, 6-7 B. A constant
// in memory: built on the stack, GCC 12 dropped the stores of colsb before
// ldtilecfg (it does not see the instruction read them), which then faulted.
struct alignas(64) AmxConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
constexpr AmxConfig kAmxConfig = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

inline void amx_configure() { _tile_loadconfig(&kAmxConfig); }

// Where the tiles of an operand lie, in bytes: a tile's rows `stride`
// apart, the block's second tile `next` after the first (the second row
// tile of A, the second column tile of B), each step along k `step` on.
struct AmxOperand {
  const void* base;
  int64_t stride, next, step;
  const void* at(int64_t which, int64_t s) const {
    return static_cast<const char*>(base) + which * next + s * step;
  }
};

// C (RT × CT tiles of 16 × 16 at c, rows ldc floats apart; the first `rows`
// rows and `cols` columns of it are C's, the rest is not written) = or +=
// (accumulate) Σ over `steps` steps of A · B.
template <int RT, int CT>
void amx_block(const AmxOperand& a, const AmxOperand& b, int64_t steps, bool accumulate, float* c, int64_t ldc,
               int64_t rows, int64_t cols) {
  alignas(64) float edge[4][kAmxTile * kAmxTile];
  const auto full = [&](int r, int col) { return rows >= kAmxTile * (r + 1) && cols >= kAmxTile * (col + 1); };
  const auto at = [&](int r, int col) { return c + kAmxTile * (r * ldc + col); };
  const auto edge_in = [&](int r, int col) {
    float* e = edge[2 * r + col];
    for (int64_t i = 0; i < kAmxTile; ++i)
      for (int64_t j = 0; j < kAmxTile; ++j)
        e[i * kAmxTile + j] = i < rows - kAmxTile * r && j < cols - kAmxTile * col ? at(r, col)[i * ldc + j] : 0.0f;
    return e;
  };
  const int64_t c_stride = ldc * int64_t(sizeof(float)), edge_stride = kAmxTile * int64_t(sizeof(float));
  // The accumulators, from C or zero. (A tile number must be a constant.)
#define MHA_AMX_START(t, r, col)                             \
  if (!accumulate) _tile_zero(t);                            \
  else if (full(r, col)) _tile_loadd(t, at(r, col), c_stride); \
  else _tile_loadd(t, edge_in(r, col), edge_stride);
  MHA_AMX_START(0, 0, 0)
  if constexpr (CT == 2) { MHA_AMX_START(1, 0, 1) }
  if constexpr (RT == 2) { MHA_AMX_START(2, 1, 0) }
  if constexpr (RT == 2 && CT == 2) { MHA_AMX_START(3, 1, 1) }
#undef MHA_AMX_START
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, a.at(0, s), a.stride);
    _tile_loadd(6, b.at(0, s), b.stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CT == 2) {
      _tile_loadd(7, b.at(1, s), b.stride);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RT == 2) {
      _tile_loadd(5, a.at(1, s), a.stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (CT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
#define MHA_AMX_FINISH(t, r, col)                                                \
  if (full(r, col)) {                                                            \
    _tile_stored(t, at(r, col), c_stride);                                       \
  } else {                                                                       \
    float* e = edge[t];                                                          \
    _tile_stored(t, e, edge_stride);                                             \
    for (int64_t i = 0; i < kAmxTile && i < rows - kAmxTile * r; ++i)            \
      for (int64_t j = 0; j < kAmxTile && j < cols - kAmxTile * col; ++j)        \
        at(r, col)[i * ldc + j] = e[i * kAmxTile + j];                           \
  }
  MHA_AMX_FINISH(0, 0, 0)
  if constexpr (CT == 2) { MHA_AMX_FINISH(1, 0, 1) }
  if constexpr (RT == 2) { MHA_AMX_FINISH(2, 1, 0) }
  if constexpr (RT == 2 && CT == 2) { MHA_AMX_FINISH(3, 1, 1) }
#undef MHA_AMX_FINISH
}

// C (row_tiles × col_tiles tiles of 16 × 16) = or += Σ_s A · B over every
// block of 2 × 2 tiles (1 at an odd edge): A's row tile r at a.at(r, s),
// B's column tile t at b.at(t, s); C's first `rows` × `cols` are written.
inline void amx_product(const AmxOperand& a, int64_t row_tiles, const AmxOperand& b, int64_t col_tiles, int64_t steps,
                        bool accumulate, float* c, int64_t ldc, int64_t rows, int64_t cols) {
  for (int64_t rt = 0; rt < row_tiles; rt += 2)
    for (int64_t ct = 0; ct < col_tiles; ct += 2) {
      const AmxOperand ab{a.at(rt, 0), a.stride, a.next, a.step}, bb{b.at(ct, 0), b.stride, b.next, b.step};
      float* out = c + kAmxTile * (rt * ldc + ct);
      const int64_t r = rows - kAmxTile * rt, n = cols - kAmxTile * ct;
      if (rt + 1 < row_tiles) {
        if (ct + 1 < col_tiles) amx_block<2, 2>(ab, bb, steps, accumulate, out, ldc, r, n);
        else amx_block<2, 1>(ab, bb, steps, accumulate, out, ldc, r, n);
      } else {
        if (ct + 1 < col_tiles) amx_block<1, 2>(ab, bb, steps, accumulate, out, ldc, r, n);
        else amx_block<1, 1>(ab, bb, steps, accumulate, out, ldc, r, n);
      }
    }
}

// r[i] (16 words) = column i of the 16 × 16 words r: four rounds of
// shuffles, from 32-bit pairs in each 128-bit lane to whole lanes.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2)
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  // u[4g + x], lane l: words 4l + x of rows 4g … 4g + 3.
  __m512i u[16];
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]), u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]), u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  // Row 4l + x of the result: lane l of u[x], u[4 + x], u[8 + x], u[12 + x].
  for (int x = 0; x < 4; ++x) {
    const __m512i even_lo = _mm512_shuffle_i32x4(u[x], u[4 + x], 0x88), odd_lo = _mm512_shuffle_i32x4(u[x], u[4 + x], 0xdd);
    const __m512i even_hi = _mm512_shuffle_i32x4(u[8 + x], u[12 + x], 0x88),
                  odd_hi = _mm512_shuffle_i32x4(u[8 + x], u[12 + x], 0xdd);
    r[x] = _mm512_shuffle_i32x4(even_lo, even_hi, 0x88), r[8 + x] = _mm512_shuffle_i32x4(even_lo, even_hi, 0xdd);
    r[4 + x] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0x88), r[12 + x] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0xdd);
  }
}

}  // namespace
}  // namespace mha::cpu
