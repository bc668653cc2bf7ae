// The layer kernels built for scalar (see kernel.h).

#define MHA_ISA_NAMESPACE scalar
#include "cpu/layers/kernel.h"

#include "cpu/layers/kernels.h"

namespace mha::cpu {

const LayerKernels& layer_kernels_scalar() {
  static const LayerKernels k{&scalar::activation_rows, &scalar::activation_backward_rows, &scalar::layer_norm_rows,
                              &scalar::layer_norm_backward_rows, &scalar::cross_entropy_rows, &scalar::adamw_range,
                              &scalar::sum_of_squares_range, &scalar::scale_range, &scalar::add_range,
                              &scalar::finite_rows};
  return k;
}

}  // namespace mha::cpu
