// The fused attention kernels built for avx512 (see kernel.h).
#define MHA_SIMD_AVX512 1
#define MHA_ISA_NAMESPACE avx512
#include "cpu/flash/kernel.h"

namespace mha::cpu {

void flash_forward_tile_avx512(const FlashForwardTile& t) { avx512::forward_tile(t); }
void flash_backward_head_avx512(const FlashBackwardHead& h) { avx512::backward_head(h); }
void flash_decode_rows_avx512(const FlashDecodeRows& d) { avx512::decode_rows(d); }
void flash_backward_rows_avx512(const FlashBackwardHead& h) { avx512::backward_rows(h); }
void flash_forward_tile_bf16_avx512(const FlashForwardTile& t) { avx512::forward_tile_bf16(t); }
void flash_backward_head_bf16_avx512(const FlashBackwardHead& h) { avx512::backward_head_bf16(h); }

}  // namespace mha::cpu
