// The layer kernels built for avx2 (see kernel.h).
#define MHA_SIMD_AVX2 1
#define MHA_ISA_NAMESPACE avx2
#include "cpu/layers/kernel.h"

namespace mha::cpu {

const LayerKernels& layer_kernels_avx2() {
  static const LayerKernels k = avx2::kernel_table();
  return k;
}

}  // namespace mha::cpu
