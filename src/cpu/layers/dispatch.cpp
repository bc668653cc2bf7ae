// The layer kernels above the instruction sets: the kernel table of the
// active ISA, rows split over OpenMP threads, and sums over rows taken per
// block (bounds fixed by the row count) and then over blocks in order, so
// that no result depends on the thread count.
#include <omp.h>

#include <algorithm>
#include <type_traits>

#include "cpu/flash/dispatch.h"
#include "cpu/layers/kernels.h"
#include "cpu/scratch.h"

namespace mha::cpu {

namespace {

const LayerKernels& kernels() {
  switch (active_isa()) {
    case Isa::avx512: return layer_kernels_avx512();
    case Isa::avx2: return layer_kernels_avx2();
    case Isa::scalar: break;
  }
  return layer_kernels_scalar();
}

// Below this many float operations a call stays on one thread: waking the
// team costs a few microseconds, as much as ~50k element updates.
constexpr int64_t kParallelWork = 1 << 15;

// Rows in blocks of at least kMinBlockRows, at most kMaxBlocks blocks.
constexpr int64_t kMinBlockRows = 8, kMaxBlocks = 32;

struct Blocks {
  int64_t rows_per_block, count;
};

Blocks blocks_of(int64_t rows) {
  const int64_t per = std::max(kMinBlockRows, (rows + kMaxBlocks - 1) / kMaxBlocks);
  return {per, (rows + per - 1) / per};
}

// Grow-only scratch of the calling thread (no fresh pages in a steady state).
template <class T>
T* scratch(ScratchSlot slot, int64_t n) {
  return static_cast<T*>(thread_scratch_bytes(slot, n * int64_t(sizeof(T))));
}

// f(begin, end) over [0, rows) in blocks, on threads when work is large;
// handed out as threads come free (the two vCPUs of a shared host ran at
// different speeds, and static halves left one idle: a millisecond per call
// at L = 2040). Each block's sums are its own, so results do not change.
template <class F>
void for_blocks(const Blocks& b, int64_t rows, int64_t work, F&& f) {
#pragma omp parallel for schedule(dynamic, 1) if (work >= kParallelWork && b.count > 1)
  for (int64_t i = 0; i < b.count; ++i) f(i, i * b.rows_per_block, std::min(rows, (i + 1) * b.rows_per_block));
}

// out (n) += Σ_blocks partial[block] (n each), blocks in order.
void add_partials(const float* partial, int64_t blocks, int64_t n, float* out) {
  const LayerKernels& k = kernels();
  for (int64_t b = 0; b < blocks; ++b) k.add_range(out, partial + b * n, out, n);
}

}  // namespace

namespace {

// Out: float, or uint16_t (bfloat16's bits), each with its entry of the kernel table.
template <class Out>
void activation_forward_to(ActivationKind kind, const float* x, const float* bias, float* pre, Out* y, int64_t rows,
                           int64_t cols) {
  const LayerKernels& k = kernels();
  const auto rows_kernel = [&] {
    if constexpr (std::is_same_v<Out, float>) return k.activation_rows;
    else return k.activation_rows_bf16;
  }();
  const Blocks b = blocks_of(rows);
  for_blocks(b, rows, rows * cols * 16,
             [&](int64_t, int64_t begin, int64_t end) { rows_kernel(kind, x, bias, pre, y, begin, end, cols); });
}

template <class Out>
void activation_backward_to(ActivationKind kind, const float* x, const float* dy, Out* dx, float* dbias, int64_t rows,
                            int64_t cols) {
  const LayerKernels& k = kernels();
  const auto rows_kernel = [&] {
    if constexpr (std::is_same_v<Out, float>) return k.activation_backward_rows;
    else return k.activation_backward_rows_bf16;
  }();
  const Blocks b = blocks_of(rows);
  float* partial = dbias ? scratch<float>(ScratchSlot::layer_a, b.count * cols) : nullptr;
  if (partial) std::fill(partial, partial + b.count * cols, 0.0f);
  for_blocks(b, rows, rows * cols * 16, [&](int64_t i, int64_t begin, int64_t end) {
    rows_kernel(kind, x, dy, dx, partial ? partial + i * cols : nullptr, begin, end, cols);
  });
  if (dbias) add_partials(partial, b.count, cols, dbias);
}

}  // namespace

void activation_forward(ActivationKind kind, const float* x, const float* bias, float* pre, float* y, int64_t rows,
                        int64_t cols) {
  activation_forward_to(kind, x, bias, pre, y, rows, cols);
}
void activation_forward(ActivationKind kind, const float* x, const float* bias, float* pre, bfloat16* y, int64_t rows,
                        int64_t cols) {
  activation_forward_to(kind, x, bias, pre, reinterpret_cast<uint16_t*>(y), rows, cols);
}

void activation_backward(ActivationKind kind, const float* x, const float* dy, float* dx, float* dbias, int64_t rows,
                         int64_t cols) {
  activation_backward_to(kind, x, dy, dx, dbias, rows, cols);
}
void activation_backward(ActivationKind kind, const float* x, const float* dy, bfloat16* dx, float* dbias,
                         int64_t rows, int64_t cols) {
  activation_backward_to(kind, x, dy, reinterpret_cast<uint16_t*>(dx), dbias, rows, cols);
}

void layer_norm_forward(const LayerNormForward& p) {
  const LayerKernels& k = kernels();
  const Blocks b = blocks_of(p.rows);
  for_blocks(b, p.rows, p.rows * p.D * 6, [&](int64_t, int64_t begin, int64_t end) { k.layer_norm_rows(p, begin, end); });
}

void layer_norm_backward(const LayerNormBackward& p) {
  const LayerKernels& k = kernels();
  const Blocks b = blocks_of(p.rows);
  const bool affine = p.dweight != nullptr;
  float* partial = affine ? scratch<float>(ScratchSlot::layer_a, 2 * b.count * p.D) : nullptr;
  if (partial) std::fill(partial, partial + 2 * b.count * p.D, 0.0f);
  for_blocks(b, p.rows, p.rows * p.D * 10, [&](int64_t i, int64_t begin, int64_t end) {
    float* dw = affine ? partial + 2 * i * p.D : nullptr;
    k.layer_norm_backward_rows(p, begin, end, dw, affine ? dw + p.D : nullptr);
  });
  if (!affine) return;
  for (int64_t i = 0; i < b.count; ++i) {
    k.add_range(p.dweight, partial + 2 * i * p.D, p.dweight, p.D);
    k.add_range(p.dbias, partial + (2 * i + 1) * p.D, p.dbias, p.D);
  }
}

double cross_entropy_forward_backward(const CrossEntropy& p, int64_t* count, int64_t* correct) {
  const LayerKernels& k = kernels();
  double* loss = scratch<double>(ScratchSlot::layer_a, p.rows);
  uint8_t* right = scratch<uint8_t>(ScratchSlot::layer_b, p.rows);
  const Blocks b = blocks_of(p.rows);
  for_blocks(b, p.rows, p.rows * p.C * 20,
             [&](int64_t, int64_t begin, int64_t end) { k.cross_entropy_rows(p, begin, end, loss, right); });
  double total = 0;
  *count = *correct = 0;
  for (int64_t r = 0; r < p.rows; ++r) {
    total += loss[r];
    *count += p.targets[r] != p.ignore_index;
    *correct += right[r];
  }
  return total;
}

namespace {
// Element ranges of a flat sweep: fixed-size chunks (a multiple of every width).
constexpr int64_t kChunk = 1 << 14;
}  // namespace

void adamw_step(const AdamWStep& p) {
  const LayerKernels& k = kernels();
  const int64_t chunks = (p.n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (p.n * 12 >= kParallelWork && chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) k.adamw_range(p, c * kChunk, std::min(p.n, (c + 1) * kChunk));
}

double sum_of_squares(const float* x, int64_t n) {
  const LayerKernels& k = kernels();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  double* partial = scratch<double>(ScratchSlot::layer_c, chunks);
#pragma omp parallel for schedule(static) if (n * 2 >= kParallelWork && chunks > 1)
  for (int64_t c = 0; c < chunks; ++c)
    partial[c] = double(k.sum_of_squares_range(x + c * kChunk, std::min(n, (c + 1) * kChunk) - c * kChunk));
  double total = 0;
  for (int64_t c = 0; c < chunks; ++c) total += partial[c];
  return total;
}

void scale_in_place(float* x, int64_t n, float s) {
  const LayerKernels& k = kernels();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n >= kParallelWork && chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) k.scale_range(x + c * kChunk, std::min(n, (c + 1) * kChunk) - c * kChunk, s);
}

bool finite_floats(const float* x, int64_t rows, int64_t cols, int64_t pitch) {
  return kernels().finite_rows(x, rows, cols, pitch);
}

void add_arrays(const float* a, const float* b, float* out, int64_t n) {
  const LayerKernels& k = kernels();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n >= kParallelWork && chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t o = c * kChunk;
    k.add_range(a + o, b + o, out + o, std::min(n, o + kChunk) - o);
  }
}

namespace {

template <class X>
void add_column_sums_of(const X* x, int64_t rows, int64_t cols, float* out) {
  const LayerKernels& k = kernels();
  const Blocks b = blocks_of(rows);
  float* partial = scratch<float>(ScratchSlot::layer_c, b.count * cols);
  std::fill(partial, partial + b.count * cols, 0.0f);
  for_blocks(b, rows, rows * cols, [&](int64_t i, int64_t begin, int64_t end) {
    // Rows of this block into its partial, columns all at once.
    float* sum = partial + i * cols;
    for (int64_t r = begin; r < end; ++r) {
      if constexpr (std::is_same_v<X, float>) k.add_range(sum, x + r * cols, sum, cols);
      else k.add_range_bf16(sum, x + r * cols, sum, cols);
    }
  });
  add_partials(partial, b.count, cols, out);
}

}  // namespace

void add_column_sums(const float* x, int64_t rows, int64_t cols, float* out) {
  add_column_sums_of(x, rows, cols, out);
}
void add_column_sums(const bfloat16* x, int64_t rows, int64_t cols, float* out) {
  add_column_sums_of(reinterpret_cast<const uint16_t*>(x), rows, cols, out);
}

void round_to_bf16_here(const float* src, bfloat16* dst, int64_t n) {
  kernels().round_range(src, reinterpret_cast<uint16_t*>(dst), n);
}

void round_to_bf16(const float* src, bfloat16* dst, int64_t n) {
  const LayerKernels& k = kernels();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n > (int64_t(1) << 18))
  for (int64_t c = 0; c < chunks; ++c)
    k.round_range(src + c * kChunk, reinterpret_cast<uint16_t*>(dst) + c * kChunk, std::min(kChunk, n - c * kChunk));
}

}  // namespace mha::cpu
