// The layer kernels built for avx512 (see kernel.h).
#define MHA_SIMD_AVX512 1
#define MHA_ISA_NAMESPACE avx512
#include "cpu/layers/kernel.h"

namespace mha::cpu {

const LayerKernels& layer_kernels_avx512() {
  static const LayerKernels k = avx512::kernel_table();
  return k;
}

}  // namespace mha::cpu
