// The float32 side of the fused attention's operands (bf16_operands.h has the
// bfloat16 one): strided operands read as float, operands as float32 rows
// per batch entry, where each entry's output rows lie, and query tiles packed
// transposed for the kernels (kernel.h). Used by flash/dispatch.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "attention_params.h"

namespace mha::cpu {

// Element (row, col) of a strided operand as float.
struct Loader {
  const void* base;
  DType dtype;
  float at(int64_t offset) const {
    if (dtype == DType::bfloat16) return float(static_cast<const bfloat16*>(base)[offset]);
    return static_cast<const float*>(base)[offset];
  }
  // f(typed pointer to element `offset`): the element type looked at once
  // for a whole loop (per element it cost as much as the backward's
  // products at E = 32, L = 131).
  template <class F>
  decltype(auto) typed(int64_t offset, F&& f) const {
    if (dtype == DType::bfloat16) return f(static_cast<const bfloat16*>(base) + offset);
    return f(static_cast<const float*>(base) + offset);
  }
};

// A shape without its last two dims (the batch dims of a (…, rows, cols) operand).
inline Shape leading(const Shape& s) { return Shape(s.begin(), s.end() - 2); }

// An operand as float32 rows of at least `width` readable floats: the tensor
// itself when it already is one (float32, unit element stride, last dim ==
// width), else a converted copy padded with zeros to `width`.
struct FloatRows {
  Tensor tensor;
  std::vector<int64_t> offset;  // per output batch entry
  int64_t row = 0;
  const float* at(int64_t b) const { return tensor.data<float>() + offset[size_t(b)]; }
  const uint16_t* at16(int64_t b) const { return &tensor.data<bfloat16>()[offset[size_t(b)]].bits; }
};

// The float32 rows of t, `width` wide (zero-padded past t's last dim), as
// they are where they can be, else copied. With `compact`, rows apart (the
// heads of an (N, L, H·E) tensor or of the packed q, k, v: 1-3 KiB) are copied
// together too (with `as_bf16`: t's bfloat16 rows as they are where they can
// be). Rows 1 KiB apart fall into a quarter of L1's sets: the forward at
// L = 2040, E = 64 on views of a packed projection took 11-13% longer than on
// contiguous copies of the same rows; copying K and V gets most of that
// back (21.3-22.3 against 22.6-23.4 ms), copying either alone nothing.
FloatRows float_rows(const Tensor& t, const AttentionParams& p, int64_t width, bool compact = false,
                     bool as_bf16 = false);

// Where each batch entry's rows of an output lie: out (or a gradient) may be
// a view with a unit last stride, such as the heads of an (N, L, H·E) tensor.
struct EntryRows {
  std::vector<int64_t> offset;  // elements, per batch entry
  int64_t row = 0;
};

EntryRows entry_rows(const Tensor& t, const AttentionParams& p);

// Rows of `rows` × `width` per entry, one entry after another.
EntryRows packed_entries(int64_t batch, int64_t rows, int64_t width);

// rows × width floats (contiguous) rounded into bfloat16 rows `row` apart.
void store_rows(const float* src, int64_t rows, int64_t width, bfloat16* dst, int64_t row);

// qt (E × br) = Q rows [i0, i0+rows) transposed; pad columns 0.
void pack_transposed(const Loader& src, int64_t base, int64_t row, int64_t col, int64_t i0, int64_t rows,
                     int64_t E, int64_t br, float* qt);

}  // namespace mha::cpu
