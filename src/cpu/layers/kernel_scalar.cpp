// The layer kernels built for scalar (see kernel.h).

#define MHA_ISA_NAMESPACE scalar
#include "cpu/layers/kernel.h"

#include "cpu/layers/kernels.h"

namespace mha::cpu {

const LayerKernels& layer_kernels_scalar() {
  static const LayerKernels k{&scalar::activation_rows<float>, &scalar::activation_backward_rows<float>,
                              &scalar::activation_rows<uint16_t>, &scalar::activation_backward_rows<uint16_t>,
                              &scalar::layer_norm_rows, &scalar::layer_norm_backward_rows,
                              &scalar::cross_entropy_rows, &scalar::adamw_range, &scalar::sum_of_squares_range,
                              &scalar::scale_range, &scalar::add_range<float>, &scalar::add_range<uint16_t>,
                              &scalar::finite_rows, &scalar::round_range};
  return k;
}

}  // namespace mha::cpu
