// The operands of the bfloat16 attention kernels (vdpbf16ps and AMX, see
// flash.h): bfloat16 rows, rows transposed and rows regrouped in pairs along
// a product's reduction, zero padded to what each kernel reads; packed by
// flash/dispatch.cpp before its regions.
#pragma once

#include <cstdint>
#include <vector>

#include "attention_params.h"

namespace mha::cpu {

// A bfloat16 operand, per output batch entry.
struct Bf16Rows {
  Tensor tensor;
  std::vector<int64_t> offset;  // per output batch entry
  int64_t row = 0;
  const uint16_t* at(int64_t b) const { return &tensor.data<bfloat16>()[offset[size_t(b)]].bits; }
};

// t (…, n, E) as rows of pairs: unit element stride, `width` elements (at
// least E, even) and `rows` rows (at least n), an even row stride and offset
// (t itself where it has them, else a zero-padded copy).
Bf16Rows bf16_rows(const Tensor& t, const AttentionParams& p, int64_t width, int64_t rows);
// t (…, n, E) transposed, (…, rows, cols) with zeros past E and n.
Bf16Rows bf16_transposed(const Tensor& t, const AttentionParams& p, int64_t rows, int64_t cols);
// t (…, n, E) regrouped in row pairs, (…, pair_rows, width, 2): element (j, e)
// at ((j/2)·width + e)·2 + j%2, zeros past n and E.
Bf16Rows bf16_pairs(const Tensor& t, const AttentionParams& p, int64_t width, int64_t pair_rows);

// Pair rows along e of a query tile: the AMX kernel reads whole steps of 32.
inline int64_t bf16_e_pairs(bool amx, int64_t E) { return amx ? (E + 31) / 32 * 16 : (E + 1) / 2; }

// qt2 (pairs, br, 2) = query pairs (e, e+1) of rows [i0, i0+rows) of q (row,
// col strides); pads 0.
void pack_query_pairs(const bfloat16* q, int64_t row, int64_t col, int64_t i0, int64_t rows, int64_t E, int64_t pairs,
                      int64_t br, uint16_t* qt2);
// x rows [0, L) (row, col strides) regrouped in row pairs, (L_pad/2, width,
// 2): element (i, e) at ((i/2)·width + e)·2 + i%2, zeros past L and E.
void pack_row_pairs(const bfloat16* x, int64_t row, int64_t col, int64_t L, int64_t E, int64_t L_pad, int64_t width,
                    uint16_t* out);

}  // namespace mha::cpu
