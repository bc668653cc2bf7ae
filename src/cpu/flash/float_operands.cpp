// Operands of the float32 attention kernels (float_operands.h).
#include "cpu/flash/float_operands.h"

#include <type_traits>

#include "cpu/transpose.h"

namespace mha::cpu {

FloatRows float_rows(const Tensor& t, const AttentionParams& p, int64_t width, bool compact, bool as_bf16) {
  FloatRows r;
  const int64_t n = t.size(-1);
  const DType kept = as_bf16 ? DType::bfloat16 : DType::float32;
  if (t.dtype() == kept && t.stride(-1) == 1 && n == width && (!compact || t.stride(-2) == width)) {
    r.tensor = t;
  } else {
    Shape padded = t.shape();
    padded.back() = width;
    r.tensor = n == width ? Tensor::empty(padded, DType::float32) : Tensor::zeros(padded, DType::float32);
    r.tensor.slice(-1, 0, n).copy_(t);
  }
  r.offset = batch_offsets(p.batch_shape, leading(r.tensor.shape()), leading(r.tensor.strides()));
  r.row = r.tensor.stride(-2);
  return r;
}

EntryRows entry_rows(const Tensor& t, const AttentionParams& p) {
  return {batch_offsets(p.batch_shape, leading(t.shape()), leading(t.strides())), t.stride(-2)};
}

EntryRows packed_entries(int64_t batch, int64_t rows, int64_t width) {
  EntryRows r{std::vector<int64_t>(size_t(batch)), width};
  for (int64_t b = 0; b < batch; ++b) r.offset[size_t(b)] = b * rows * width;
  return r;
}

void store_rows(const float* src, int64_t rows, int64_t width, bfloat16* dst, int64_t row) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t x = 0; x < width; ++x) dst[i * row + x] = bfloat16(src[i * width + x]);
}

// Float32 rows along e (col = 1) go by 4 × 4 blocks transposed in registers
// (cpu/transpose.h): element by element, the copy down qt's columns took 7%
// of the backward at L = 131, E = 32 (one load and one store per float, each
// row of Q read once per e).
void pack_transposed(const Loader& src, int64_t base, int64_t row, int64_t col, int64_t i0, int64_t rows,
                     int64_t E, int64_t br, float* qt) {
  src.typed(base + i0 * row, [&](const auto* first) {
    int64_t done = 0;  // rows transposed by blocks
    if constexpr (std::is_same_v<std::remove_cv_t<std::remove_pointer_t<decltype(first)>>, float>)
      if (col == 1) transpose_block(first, row, rows, E, qt, br), done = rows;
    for (int64_t e = 0; e < E; ++e) {
      float* dst = qt + e * br;
      for (int64_t i = done; i < rows; ++i) dst[i] = float(first[i * row + e * col]);
      for (int64_t i = rows; i < br; ++i) dst[i] = 0.0f;
    }
  });
}

}  // namespace mha::cpu
