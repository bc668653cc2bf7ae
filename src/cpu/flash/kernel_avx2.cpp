// The fused attention kernels built for avx2 (see kernel.h).
#define MHA_SIMD_AVX2 1
#define MHA_ISA_NAMESPACE avx2
#include "cpu/flash/kernel.h"

namespace mha::cpu {

void flash_forward_tile_avx2(const FlashForwardTile& t) { avx2::forward_tile(t); }
void flash_backward_head_avx2(const FlashBackwardHead& h) { avx2::backward_head(h); }
void flash_decode_rows_avx2(const FlashDecodeRows& d) { avx2::decode_rows(d); }
void flash_backward_rows_avx2(const FlashBackwardHead& h) { avx2::backward_rows(h); }

}  // namespace mha::cpu
