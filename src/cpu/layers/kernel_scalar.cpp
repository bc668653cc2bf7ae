// The layer kernels built for scalar (see kernel.h).

#define MHA_ISA_NAMESPACE scalar
#include "cpu/layers/kernel.h"

namespace mha::cpu {

const LayerKernels& layer_kernels_scalar() {
  static const LayerKernels k = scalar::kernel_table();
  return k;
}

}  // namespace mha::cpu
