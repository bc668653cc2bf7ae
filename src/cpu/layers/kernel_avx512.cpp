// The layer kernels built for avx512 (see kernel.h).
#define MHA_SIMD_AVX512 1
#define MHA_ISA_NAMESPACE avx512
#include "cpu/layers/kernel.h"

#include "cpu/layers/kernels.h"

namespace mha::cpu {

const LayerKernels& layer_kernels_avx512() {
  static const LayerKernels k{&avx512::activation_rows<float>, &avx512::activation_backward_rows<float>,
                              &avx512::activation_rows<uint16_t>, &avx512::activation_backward_rows<uint16_t>,
                              &avx512::layer_norm_rows, &avx512::layer_norm_backward_rows,
                              &avx512::cross_entropy_rows, &avx512::adamw_range, &avx512::sum_of_squares_range,
                              &avx512::scale_range, &avx512::add_range<float>, &avx512::add_range<uint16_t>,
                              &avx512::finite_rows, &avx512::round_range};
  return k;
}

}  // namespace mha::cpu
