// Layer kernels around attention, float32: activations (fused with the bias
// add), LayerNorm (fused with the residual add), softmax + cross-entropy,
// AdamW and the gradient norm. Each is written once against cpu/simd/vec.h
// (layers/kernel.h), built per instruction set and chosen at run time with
// the fused attention's choice (active_isa()); the plain loops they replace
// stay as the reference path (layers/reference.h). Kernels know no layers:
// they take pointers, sizes and scalars, checked by their callers.
//
// Rows are split over OpenMP threads; every sum over rows is taken in blocks
// whose bounds depend on the row count only, then over the blocks in order,
// so results do not depend on the number of threads.
#pragma once

#include <cstdint>

#include "mha/dtype.h"

namespace mha::cpu {

enum class ActivationKind : uint8_t { relu, gelu, gelu_tanh };

// y = f(x + bias) over rows × cols, bias (cols) or null. When pre is not null
// it receives x + bias (backward's input); pre may be x itself, y may be x.
void activation_forward(ActivationKind kind, const float* x, const float* bias, float* pre, float* y, int64_t rows,
                        int64_t cols);
// dx = dy · f'(x), x the pre-activation; dbias (cols), when not null, += Σ_rows dx.
// dx may be dy.
void activation_backward(ActivationKind kind, const float* x, const float* dy, float* dx, float* dbias, int64_t rows,
                         int64_t cols);
// The same two with y / dx rounded to bfloat16 as they are stored (nearest
// even, as bfloat16's constructor): the operand a bf16 product takes next,
// with no float32 copy in between. dbias still sums dx before rounding.
void activation_forward(ActivationKind kind, const float* x, const float* bias, float* pre, bfloat16* y, int64_t rows,
                        int64_t cols);
void activation_backward(ActivationKind kind, const float* x, const float* dy, bfloat16* dx, float* dbias,
                         int64_t rows, int64_t cols);

// LayerNorm over rows of D: y = (h - μ)·r·weight + bias, r = 1/√(σ² + eps),
// with h = x, or h = x + residual written to `sum` (the residual stream of
// a Pre-LN block). weight/bias may be null (no affine). Saves μ, r per row.
// The parameter structs are templates so that the reference path
// (cpu/reference/layers.h) takes them in float64 too.
template <class T>
struct LayerNormForwardOf {
  const T* x = nullptr;
  const T* residual = nullptr;  // optional: h = x + residual
  T* sum = nullptr;             // receives h when residual is given (may be x)
  const T* weight = nullptr;
  const T* bias = nullptr;
  T* y = nullptr;
  T* mean = nullptr;  // (rows)
  T* rstd = nullptr;  // (rows)
  int64_t rows = 0, D = 0;
  double eps = 1e-5;
};
using LayerNormForward = LayerNormForwardOf<float>;
void layer_norm_forward(const LayerNormForward& p);

// dx = r·(g - mean(g) - x̂·mean(g·x̂)) + residual_grad, g = dy·weight,
// x̂ = (h - μ)·r; dweight += Σ dy·x̂, dbias += Σ dy over the rows (when not null).
template <class T>
struct LayerNormBackwardOf {
  const T* h = nullptr;  // the normalised input
  const T* dy = nullptr;
  const T* weight = nullptr;
  const T* mean = nullptr;
  const T* rstd = nullptr;
  const T* residual_grad = nullptr;  // optional: added to dx (may be dx)
  T* dx = nullptr;
  T* dweight = nullptr;
  T* dbias = nullptr;
  int64_t rows = 0, D = 0;
};
using LayerNormBackward = LayerNormBackwardOf<float>;
void layer_norm_backward(const LayerNormBackward& p);

// Softmax cross-entropy over rows of C logits with torch's ignore_index and
// label smoothing ε (target weight 1 - ε + ε/C, others ε/C); dlogits =
// (softmax - q) · grad_scale, 0 on ignored rows. Returns the sum of the rows'
// losses; *count and *correct get the rows not ignored and those whose first
// largest logit is the target.
template <class T>
struct CrossEntropyOf {
  const T* logits = nullptr;
  const int64_t* targets = nullptr;
  T* dlogits = nullptr;
  int64_t rows = 0, C = 0, ignore_index = -100;
  double label_smoothing = 0.0, grad_scale = 1.0;
};
using CrossEntropy = CrossEntropyOf<float>;
double cross_entropy_forward_backward(const CrossEntropy& p, int64_t* count, int64_t* correct);

// One AdamW update of n parameters (optim.h's rule), in float32:
//   p ← p·(1 - lr·wd);  m ← β1 m + (1-β1) g;  v ← β2 v + (1-β2) g²
//   p ← p - lr·(m / bias1) / (√(v / bias2) + eps)
template <class T>
struct AdamWStepOf {
  T *param = nullptr, *exp_avg = nullptr, *exp_avg_sq = nullptr;
  const T* grad = nullptr;
  int64_t n = 0;
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, bias1 = 1, bias2 = 1;
};
using AdamWStep = AdamWStepOf<float>;
void adamw_step(const AdamWStep& p);

// Σ x² in float64 (float32 within fixed blocks); x *= s.
double sum_of_squares(const float* x, int64_t n);
void scale_in_place(float* x, int64_t n, float s);

// out += Σ_rows x over rows × cols (a bias's gradient).
void add_column_sums(const float* x, int64_t rows, int64_t cols, float* out);
// The same over bfloat16 x (each widened exactly): the same sums, in the same
// order, as over a float32 copy of x.
void add_column_sums(const bfloat16* x, int64_t rows, int64_t cols, float* out);
// dst[i] = src[i] rounded to bfloat16 (nearest even, as bfloat16's
// constructor; NaN stays NaN, quiet; denormals kept), on threads when n is large.
void round_to_bf16(const float* src, bfloat16* dst, int64_t n);
// The same on the calling thread (a row inside a parallel loop).
void round_to_bf16_here(const float* src, bfloat16* dst, int64_t n);
// out = a + b over n (out may be a or b).
void add_arrays(const float* a, const float* b, float* out, int64_t n);
// Whether rows × cols floats, rows `pitch` apart, hold no NaN and no infinity
// (on the calling thread: it runs inside the attention's parallel regions).
bool finite_floats(const float* x, int64_t rows, int64_t cols, int64_t pitch);
inline bool finite_floats(const float* x, int64_t n) { return finite_floats(x, 1, n, n); }

}  // namespace mha::cpu
