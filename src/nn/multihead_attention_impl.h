// What MultiheadAttention's files share (multihead_attention.cpp: forward
// and backward; multihead_attention_decode.cpp: decoding and head surgery):
// sequence layouts, the projections as products over rows, input checks.
//
// Widths: D = embed_dim (the module's input and output rows), I = H·hd (the
// heads concatenated: q, k, v, the KV cache and out_proj's input), kdim and
// vdim (the key and value inputs). I = D unless heads were pruned or the
// config sets head_dim.
#pragma once

#include <string>
#include <vector>

#include "check.h"
#include "cpu/gemm.h"
#include "mha/nn/multihead_attention.h"
#include "mha/nn/positional.h"
#include "nn/layer_util.h"

namespace mha::nn::detail {

// Row (n, l) of a sequence tensor, (L, N, X), (N, L, X) when batch_first, or
// unbatched (L, X), sits at data + n·batch_stride + l·seq_stride.
struct SeqLayout {
  int64_t N = 1, L = 0, X = 0, seq_stride = 0, batch_stride = 0;
};

inline SeqLayout layout_of(const Shape& shape, bool batch_first) {
  SeqLayout s;
  s.X = shape.back();
  if (shape.size() == 2) {
    s.L = shape[0], s.seq_stride = s.X;
  } else if (batch_first) {
    s.N = shape[0], s.L = shape[1], s.seq_stride = s.X, s.batch_stride = s.L * s.X;
  } else {
    s.L = shape[0], s.N = shape[1], s.seq_stride = s.N * s.X, s.batch_stride = s.X;
  }
  return s;
}

// Whether the N·L rows of a layout are evenly spaced (batch_first or
// unbatched, contiguous): then a product over every batch entry is one GEMM
// of N·L rows, row stride seq_stride.
inline bool rows_in_order(const SeqLayout& s) { return s.N == 1 || s.batch_stride == s.L * s.seq_stride; }


// y_n = x_n Wᵀ + b for each batch entry n: W (Y, X), y (N, L, Y) contiguous.
template <class T, class A>
void project(const A* x, const SeqLayout& xs, const A* w, const T* bias, int64_t Y, T* y) {
  if (rows_in_order(xs)) return cpu::gemm_bias(false, true, xs.N * xs.L, Y, xs.X, x, xs.seq_stride, w, xs.X, bias, y, Y);
  for (int64_t n = 0; n < xs.N; ++n)
    cpu::gemm_bias(false, true, xs.L, Y, xs.X, x + n * xs.batch_stride, xs.seq_stride, w, xs.X, bias, y + n * xs.L * Y, Y);
}

// Backward of project for rows [0, L) of dy (N, Ly, Y), given as T (for
// the bias) and as the operand dy_op:
//   dW += Σ_n dy_nᵀ x_n,  db += Σ_n Σ_l dy_n   (project_weight_backward)
//   dx_n = dy_n W                              (project_input_backward: dy's
//                                               rows dy_row apart, Y of them read)
// (dy: what the bias gradient sums, T or, under bf16-mixed, the rounded dy_op itself.)
template <class T, class A, class D>
void project_weight_backward(const D* dy, const A* dy_op, int64_t Ly, const A* x, const SeqLayout& xs, int64_t Y,
                             T* dw, T* dbias) {
  if (rows_in_order(xs) && (xs.N == 1 || Ly == xs.L)) {
    const int64_t rows = xs.N * xs.L;
    cpu::gemm(true, false, Y, xs.X, rows, T(1), dy_op, Y, x, xs.seq_stride, T(1), dw, xs.X);
    if (dbias) add_bias_gradient(dy, rows, Y, dbias);
    return;
  }
  for (int64_t n = 0; n < xs.N; ++n) {
    cpu::gemm(true, false, Y, xs.X, xs.L, T(1), dy_op + n * Ly * Y, Y, x + n * xs.batch_stride, xs.seq_stride, T(1),
              dw, xs.X);
    if (dbias)
      for (int64_t l = 0; l < xs.L; ++l)
        for (int64_t e = 0; e < Y; ++e) dbias[e] += T(dy[(n * Ly + l) * Y + e]);
  }
}

template <class T, class A>
void project_input_backward(const A* dy_op, int64_t dy_row, int64_t Ly, const SeqLayout& xs, const A* w, int64_t Y,
                            T* dx) {
  if (rows_in_order(xs) && (xs.N == 1 || Ly == xs.L))
    return cpu::gemm(false, false, xs.N * xs.L, xs.X, Y, T(1), dy_op, dy_row, w, xs.X, T(0), dx, xs.seq_stride);
  for (int64_t n = 0; n < xs.N; ++n)
    cpu::gemm(false, false, xs.L, xs.X, Y, T(1), dy_op + n * Ly * dy_row, dy_row, w, xs.X, T(0),
              dx + n * xs.batch_stride, xs.seq_stride);
}

template <class T, class A>
void project_backward(const T* dy, const A* dy_op, int64_t Ly, const A* x, const SeqLayout& xs, const A* w,
                      int64_t Y, T* dw, T* dbias, T* dx) {
  project_weight_backward<T, A>(dy, dy_op, Ly, x, xs, Y, dw, dbias);
  project_input_backward<T, A>(dy_op, Y, Ly, xs, w, Y, dx);
}

// output = heads Woᵀ + bo: heads (N, L, I) contiguous, Wo (D, I), output
// rows (width D) in layout os. With I = 0 (no heads) the output is bo.
template <class T, class A>
void project_out(const A* heads, int64_t I, const SeqLayout& os, const A* w, const T* bias, T* output) {
  const int64_t D = os.X;
  if (rows_in_order(os)) return cpu::gemm_bias(false, true, os.N * os.L, D, I, heads, I, w, I, bias, output, os.seq_stride);
  for (int64_t n = 0; n < os.N; ++n)
    cpu::gemm_bias(false, true, os.L, D, I, heads + n * os.L * I, I, w, I, bias, output + n * os.batch_stride,
                   os.seq_stride);
}

// (N, R, H·hd) contiguous  <->  (N, H, R, hd) view of the same memory.
inline Tensor split_heads(const Tensor& t, int64_t H, int64_t hd) {
  return t.view({t.size(0), t.size(1), H, hd}).permute({0, 2, 1, 3});
}

// The heads of part (0: q, 1: k, 2: v) of fused projections (N, L, 3·H·hd),
// each row q, k and v side by side: an (N, H, L, hd) view.
inline Tensor projection_heads(const Tensor& qkv, int part, int64_t H, int64_t hd) {
  return qkv.view({qkv.size(0), qkv.size(1), 3, H, hd}).select(2, part).permute({0, 2, 1, 3});
}

// RoPE through the (N, H, R, hd) view of rows [begin, end) of t (N, R, H·hd),
// the first of them at position `position`.
inline void rotate_rows(const Tensor& t, int64_t H, int64_t hd, int64_t begin, int64_t end, int64_t position,
                        double base, bool inverse = false) {
  rotate_positions_(split_heads(t, H, hd).slice(2, begin, end), position, base, inverse);
}

template <class T>
const T* ptr_or_null(const Tensor& t, int64_t offset = 0) {
  return t.defined() ? t.data<T>() + offset : nullptr;
}
template <class T>
T* mut_ptr_or_null(Tensor& t, int64_t offset = 0) {
  return t.defined() ? t.data<T>() + offset : nullptr;
}

// t: defined, of `dtype`, on the CPU, `rank` dims, the last `last`, none empty.
void check_input(const char* fn, const Tensor& t, const char* name, int64_t rank, int64_t last, const char* last_name,
                 DType dtype);
// A query-like sequence: (L, N, D), (N, L, D) or unbatched (L, D), of the
// module's dtype, non-empty. Returns its rank.
int64_t check_sequence(const char* fn, const Tensor& t, const char* name, int64_t D, DType dtype);
// Every parameter contiguous, of `dtype`, shaped like its grad.
void check_parameters(const char* fn, const std::vector<NamedParameter>& parameters, DType dtype);

}  // namespace mha::nn::detail
