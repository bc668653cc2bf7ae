// The table of one instruction set's layer kernels (kernel.h), for dispatch.cpp.
#pragma once

#include "cpu/layers/layers.h"

namespace mha::cpu {

struct LayerKernels {
  void (*activation_rows)(ActivationKind, const float*, const float*, float*, float*, int64_t, int64_t, int64_t);
  void (*activation_backward_rows)(ActivationKind, const float*, const float*, float*, float*, int64_t, int64_t,
                                   int64_t);
  // The same with the output rounded to bfloat16 (its bits).
  void (*activation_rows_bf16)(ActivationKind, const float*, const float*, float*, uint16_t*, int64_t, int64_t,
                               int64_t);
  void (*activation_backward_rows_bf16)(ActivationKind, const float*, const float*, uint16_t*, float*, int64_t,
                                        int64_t, int64_t);
  void (*layer_norm_rows)(const LayerNormForward&, int64_t, int64_t);
  void (*layer_norm_backward_rows)(const LayerNormBackward&, int64_t, int64_t, float*, float*);
  void (*cross_entropy_rows)(const CrossEntropy&, int64_t, int64_t, double*, uint8_t*);
  void (*adamw_range)(const AdamWStep&, int64_t, int64_t);
  float (*sum_of_squares_range)(const float*, int64_t);
  void (*scale_range)(float*, int64_t, float);
  void (*add_range)(const float*, const float*, float*, int64_t);
  void (*add_range_bf16)(const float*, const uint16_t*, float*, int64_t);  // b widened from bfloat16
  bool (*finite_rows)(const float*, int64_t, int64_t, int64_t);
  void (*round_range)(const float*, uint16_t*, int64_t);  // to bfloat16 (its bits)
};

const LayerKernels& layer_kernels_avx512();
const LayerKernels& layer_kernels_avx2();
const LayerKernels& layer_kernels_scalar();

}  // namespace mha::cpu
