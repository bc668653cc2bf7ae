// The layer kernels' reference path: plain loops in float64 arithmetic over
// float32 or float64 data, the semantics of cpu/layers/layers.h. The layers
// run it for float64; tests hold every instruction set's kernels to it.
#pragma once

#include "cpu/layers/layers.h"

namespace mha::cpu::reference {

template <class T>
void activation_forward(ActivationKind kind, const T* x, const T* bias, T* pre, T* y, int64_t rows, int64_t cols);
template <class T>
void activation_backward(ActivationKind kind, const T* x, const T* dy, T* dx, T* dbias, int64_t rows, int64_t cols);
template <class T>
void layer_norm_forward(const LayerNormForwardOf<T>& p);
template <class T>
void layer_norm_backward(const LayerNormBackwardOf<T>& p);
template <class T>
double cross_entropy_forward_backward(const CrossEntropyOf<T>& p, int64_t* count, int64_t* correct);
template <class T>
void adamw_step(const AdamWStepOf<T>& p);

// The scalar functions behind them, for tests at single points.
double activation(ActivationKind kind, double x);
double activation_derivative(ActivationKind kind, double x);

}  // namespace mha::cpu::reference
