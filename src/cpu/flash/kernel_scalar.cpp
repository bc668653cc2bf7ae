// The fused attention kernels built for scalar (see kernel.h).

#define MHA_ISA_NAMESPACE scalar
#include "cpu/flash/kernel.h"

namespace mha::cpu {

void flash_forward_tile_scalar(const FlashForwardTile& t) { scalar::forward_tile(t); }
void flash_backward_head_scalar(const FlashBackwardHead& h) { scalar::backward_head(h); }
void flash_decode_rows_scalar(const FlashDecodeRows& d) { scalar::decode_rows(d); }
void flash_backward_rows_scalar(const FlashBackwardHead& h) { scalar::backward_rows(h); }

}  // namespace mha::cpu
