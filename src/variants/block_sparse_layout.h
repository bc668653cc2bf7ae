// The check of a block-sparse layout against L and S (shared by the mask
// builder and the kernels).
#pragma once

#include <string>

#include "mha/variants/block_sparse.h"

namespace mha::variants {

// ValueError unless layout has block >= 1, query_blocks = ceil(L/block),
// key_blocks = ceil(S/block), query_blocks + 1 non-decreasing row offsets
// from 0 to key_block.size(), and strictly ascending in-range key blocks per row.
void check_layout(const BlockSparseLayout& layout, int64_t L, int64_t S, const std::string& fn,
                  const std::string& name);

}  // namespace mha::variants
