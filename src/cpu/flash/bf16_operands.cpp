// Packing of the bfloat16 attention kernels' operands (bf16_operands.h).
#include "cpu/flash/bf16_operands.h"

#include <omp.h>

#include <cstring>

#include "cpu/flash/float_operands.h"
#include "cpu/gemm.h"

namespace mha::cpu {

namespace {

// An uninitialised bfloat16 tensor of t's leading dims and (rows, cols).
Tensor resized(const Tensor& t, int64_t rows, int64_t cols) {
  Shape shape = t.shape();
  shape[shape.size() - 2] = rows;
  shape.back() = cols;
  return Tensor::empty(shape, DType::bfloat16);
}

Bf16Rows with_offsets(Tensor t, const AttentionParams& p) {
  Bf16Rows r;
  r.offset = batch_offsets(p.batch_shape, leading(t.shape()), leading(t.strides()));
  r.row = t.stride(-2);
  r.tensor = std::move(t);
  return r;
}

}  // namespace

// t (…, n, E) as rows of pairs: unit element stride, `width` elements (at
// least E, even) and `rows` rows (at least n), an even row stride and offset
// (zero padded where t has none of these), so that a row is read as 32-bit
// words.
Bf16Rows bf16_rows(const Tensor& t, const AttentionParams& p, int64_t width, int64_t rows) {
  const int64_t n = t.size(-2), E = t.size(-1);
  if (t.stride(-1) == 1 && E == width && n == rows && t.stride(-2) % 2 == 0 && t.offset() % 2 == 0)
    return with_offsets(t, p);
  const Tensor c = t.contiguous();
  Tensor out = resized(t, rows, width);
  const bfloat16* src = c.data<bfloat16>();
  bfloat16* dst = out.data<bfloat16>();
  const int64_t heads = shape_numel(leading(c.shape()));
#pragma omp parallel for schedule(static) if (heads * rows * width >= (int64_t(1) << 15))
  for (int64_t hj = 0; hj < heads * rows; ++hj) {
    const int64_t h = hj / rows, j = hj % rows, here = j < n ? E : 0;
    if (here) std::memcpy(dst + hj * width, src + (h * n + j) * E, size_t(E) * sizeof(bfloat16));
    std::memset(static_cast<void*>(dst + hj * width + here), 0, size_t(width - here) * sizeof(bfloat16));
  }
  return with_offsets(std::move(out), p);
}

// t (…, n, E) transposed, (…, rows, cols) with zeros past E and n.
Bf16Rows bf16_transposed(const Tensor& t, const AttentionParams& p, int64_t rows, int64_t cols) {
  const Tensor c = t.contiguous();
  const int64_t n = c.size(-2), E = c.size(-1);
  Tensor out = resized(t, rows, cols);
  const uint16_t* src = &c.data<bfloat16>()->bits;
  uint16_t* dst = &out.data<bfloat16>()->bits;
  const int64_t heads = shape_numel(leading(c.shape()));
#pragma omp parallel for schedule(static) if (heads * rows * cols >= (int64_t(1) << 15))
  for (int64_t he = 0; he < heads * rows; ++he) {
    const int64_t h = he / rows, e = he % rows;
    uint16_t* row = dst + he * cols;
    const int64_t here = e < E ? n : 0;
    for (int64_t j = 0; j < here; ++j) row[j] = src[(h * n + j) * E + e];
    std::memset(row + here, 0, size_t(cols - here) * sizeof(uint16_t));
  }
  return with_offsets(std::move(out), p);
}

// t (…, n, E) regrouped in row pairs, (…, pairs, width, 2): element (j, e)
// at ((j/2)·width + e)·2 + j%2, zeros past n and E (width ≥ E, pairs ≥ n/2).
Bf16Rows bf16_pairs(const Tensor& t, const AttentionParams& p, int64_t width, int64_t pair_rows) {
  const Tensor c = t.contiguous();
  const int64_t n = c.size(-2), E = c.size(-1), n2 = (n + 1) / 2;
  Shape pairs = leading(c.shape());
  pairs.push_back(2 * pair_rows);
  pairs.push_back(width);
  Tensor out = Tensor::empty(pairs, DType::bfloat16);
  const uint16_t* src = &c.data<bfloat16>()->bits;
  uint16_t* dst = &out.data<bfloat16>()->bits;
  const int64_t heads = shape_numel(leading(c.shape()));
  // Pair row q of head h: rows 2q and 2q + 1 interleaved (the second 0 past n).
#pragma omp parallel for schedule(static) if (heads * pair_rows * width >= (int64_t(1) << 15))
  for (int64_t hq = 0; hq < heads * pair_rows; ++hq) {
    const int64_t h = hq / pair_rows, q = hq % pair_rows;
    uint16_t* row = dst + hq * 2 * width;
    if (q >= n2) {
      std::memset(row, 0, size_t(2 * width) * sizeof(uint16_t));
      continue;
    }
    const uint16_t* even = src + (h * n + 2 * q) * E;
    interleave_pairs_avx512(even, 2 * q + 1 < n ? even + E : nullptr, E, reinterpret_cast<uint32_t*>(row));
    std::memset(row + 2 * E, 0, size_t(2 * (width - E)) * sizeof(uint16_t));
  }
  return with_offsets(std::move(out), p);
}

// qt2 (pairs, br, 2) = query pairs (e, e+1) of rows [i0, i0+rows) as bf16; pads 0.
void pack_query_pairs(const bfloat16* q, int64_t row, int64_t col, int64_t i0, int64_t rows, int64_t E, int64_t pairs,
                      int64_t br, uint16_t* qt2) {
  std::memset(qt2, 0, size_t(pairs * br * 2) * sizeof(uint16_t));
  uint32_t* words = reinterpret_cast<uint32_t*>(qt2);
  for (int64_t i = 0; i < rows; ++i) {
    const bfloat16* r = q + (i0 + i) * row;
    if (col != 1) {
      for (int64_t e = 0; e < E; ++e) qt2[((e / 2) * br + i) * 2 + e % 2] = r[e * col].bits;
      continue;
    }
    for (int64_t e2 = 0; e2 < E / 2; ++e2) std::memcpy(&words[e2 * br + i], r + 2 * e2, 4);  // a pair as one word
    if (E % 2) qt2[((E / 2) * br + i) * 2] = r[E - 1].bits;
  }
}

// x rows [0, L) (row, col strides) regrouped in row pairs, (L_pad/2, width,
// 2): element (i, e) at ((i/2)·width + e)·2 + i%2, zeros past L and E.
void pack_row_pairs(const bfloat16* x, int64_t row, int64_t col, int64_t L, int64_t E, int64_t L_pad, int64_t width,
                    uint16_t* out) {
  if (col == 1) {  // rows of E elements: interleaved a pair of rows at a time
    for (int64_t i = 0; i < L_pad; i += 2) {
      uint16_t* pair = out + i * width;
      if (i < L) interleave_pairs_avx512(&x[i * row].bits, i + 1 < L ? &x[(i + 1) * row].bits : nullptr, E,
                                         reinterpret_cast<uint32_t*>(pair));
      const int64_t here = i < L ? E : 0;
      std::memset(pair + 2 * here, 0, size_t(2 * (width - here)) * sizeof(uint16_t));
    }
    return;
  }
  for (int64_t i = 0; i < L_pad; ++i) {
    uint16_t* dst = out + (i / 2) * 2 * width + i % 2;
    for (int64_t e = 0; e < width; ++e) dst[2 * e] = i < L && e < E ? x[i * row + e * col].bits : uint16_t(0);
  }
}

}  // namespace mha::cpu
