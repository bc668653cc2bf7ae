// The layer kernels built for avx2 (see kernel.h).
#define MHA_SIMD_AVX2 1
#define MHA_ISA_NAMESPACE avx2
#include "cpu/layers/kernel.h"

#include "cpu/layers/kernels.h"

namespace mha::cpu {

const LayerKernels& layer_kernels_avx2() {
  static const LayerKernels k{&avx2::activation_rows<float>, &avx2::activation_backward_rows<float>,
                              &avx2::activation_rows<uint16_t>, &avx2::activation_backward_rows<uint16_t>,
                              &avx2::layer_norm_rows, &avx2::layer_norm_backward_rows, &avx2::cross_entropy_rows,
                              &avx2::adamw_range, &avx2::sum_of_squares_range, &avx2::scale_range,
                              &avx2::add_range<float>, &avx2::add_range<uint16_t>, &avx2::finite_rows,
                              &avx2::round_range};
  return k;
}

}  // namespace mha::cpu
