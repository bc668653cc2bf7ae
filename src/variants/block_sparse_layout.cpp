// Fixed block-sparse patterns: Sparse Transformer's strided layout, BigBird's
// global + window + random layout, and the dense mask of any layout.
// Each row is built from its few blocks directly (no per-row scan of all
// blocks except for BigBird's global rows), so building costs O(nonzero blocks).
#include <algorithm>

#include "mha/variants/block_sparse.h"
#include "random/philox.h"
#include "variants/block_sparse_layout.h"
#include "variants/common.h"

namespace mha {

namespace {

int64_t blocks_of(int64_t length, int64_t block) { return (length + block - 1) / block; }

// Appends row `cols` (any order, duplicates allowed, all in range) to the layout.
void append_row(BlockSparseLayout& layout, std::vector<int64_t>& cols) {
  std::sort(cols.begin(), cols.end());
  cols.erase(std::unique(cols.begin(), cols.end()), cols.end());
  layout.key_block.insert(layout.key_block.end(), cols.begin(), cols.end());
  layout.row_begin.push_back(int64_t(layout.key_block.size()));
}

BlockSparseLayout empty_layout(int64_t length, int64_t block) {
  BlockSparseLayout layout;
  layout.block = block;
  layout.query_blocks = layout.key_blocks = blocks_of(length, block);
  layout.row_begin.assign(1, 0);
  return layout;
}

// `count` distinct key blocks in [0, end) not in `row` (sorted), drawn by
// Philox stream `stream` of `seed`; all of them when fewer remain.
std::vector<int64_t> draw_blocks(const std::vector<int64_t>& row, int64_t end, int64_t count, uint64_t seed,
                                 uint64_t stream) {
  const int64_t taken = int64_t(std::count_if(row.begin(), row.end(), [&](int64_t j) { return j < end; }));
  const int64_t available = end - taken;
  std::vector<int64_t> drawn;
  uint64_t counter = 0;
  auto next = [&](int64_t n) {
    const PhiloxBlock r = philox_block(seed, stream, counter++);
    return int64_t(((uint64_t(r[0]) << 32) | r[1]) % uint64_t(n));
  };
  if (count >= available || available < 2 * count) {  // few left: shuffle them all, keep `count`
    for (int64_t j = 0; j < end; ++j)
      if (!std::binary_search(row.begin(), row.end(), j)) drawn.push_back(j);
    for (int64_t a = 0; a < std::min(count, int64_t(drawn.size())); ++a)
      std::swap(drawn[size_t(a)], drawn[size_t(a + next(int64_t(drawn.size()) - a))]);
    drawn.resize(size_t(std::min(count, int64_t(drawn.size()))));
    return drawn;
  }
  while (int64_t(drawn.size()) < count) {  // many left: rejection is quick
    const int64_t j = next(end);
    if (!std::binary_search(row.begin(), row.end(), j) && std::find(drawn.begin(), drawn.end(), j) == drawn.end())
      drawn.push_back(j);
  }
  return drawn;
}

}  // namespace

namespace variants {

void check_layout(const BlockSparseLayout& layout, int64_t L, int64_t S, const std::string& fn,
                  const std::string& name) {
  if (layout.block < 1) raise<ValueError>(fn, name + ".block", ">= 1", std::to_string(layout.block));
  const int64_t qb = blocks_of(L, layout.block), kb = blocks_of(S, layout.block);
  if (layout.query_blocks != qb || layout.key_blocks != kb)
    raise<ValueError>(fn, name, std::to_string(qb) + " x " + std::to_string(kb) + " blocks of " +
                                    std::to_string(layout.block) + " for L = " + std::to_string(L) +
                                    ", S = " + std::to_string(S),
                      std::to_string(layout.query_blocks) + " x " + std::to_string(layout.key_blocks));
  if (layout.row_begin.size() != size_t(qb) + 1 || layout.row_begin.front() != 0 ||
      layout.row_begin.back() != layout.nonzero_blocks())
    raise<ValueError>(fn, name + ".row_begin", std::to_string(qb + 1) + " offsets from 0 to " +
                                                   std::to_string(layout.nonzero_blocks()),
                      std::to_string(layout.row_begin.size()) + " offsets");
  for (int64_t I = 0; I < qb; ++I) {
    const int64_t a = layout.row_begin[size_t(I)], b = layout.row_begin[size_t(I) + 1];
    if (b < a) raise<ValueError>(fn, name + ".row_begin", "non-decreasing offsets", "a decrease at block " + std::to_string(I));
    for (int64_t x = a; x < b; ++x) {
      const int64_t J = layout.key_block[size_t(x)];
      if (J < 0 || J >= kb || (x > a && J <= layout.key_block[size_t(x) - 1]))
        raise<ValueError>(fn, name + ".key_block", "strictly ascending key blocks in [0, " + std::to_string(kb) + ") per row",
                          std::to_string(J) + " in row " + std::to_string(I));
    }
  }
}

}  // namespace variants

BlockSparseLayout strided_layout(int64_t length, const StridedPattern& pattern, bool causal) {
  const std::string fn = "mha::strided_layout";
  variants::check_at_least(length, 1, fn, "length");
  variants::check_at_least(pattern.block, 1, fn, "pattern.block");
  variants::check_at_least(pattern.local_blocks, 1, fn, "pattern.local_blocks");
  variants::check_at_least(pattern.stride_blocks, 1, fn, "pattern.stride_blocks");
  BlockSparseLayout layout = empty_layout(length, pattern.block);
  const int64_t n = layout.query_blocks;
  std::vector<int64_t> cols;
  for (int64_t I = 0; I < n; ++I) {
    cols.clear();
    const int64_t last = causal ? I : n - 1;
    for (int64_t J = std::max<int64_t>(0, I - pattern.local_blocks + 1); J <= std::min(last, I + pattern.local_blocks - 1); ++J)
      cols.push_back(J);
    for (int64_t J = I % pattern.stride_blocks; J <= last; J += pattern.stride_blocks) cols.push_back(J);
    append_row(layout, cols);
  }
  return layout;
}

BlockSparseLayout bigbird_layout(int64_t length, const BigBirdPattern& pattern, bool causal) {
  const std::string fn = "mha::bigbird_layout";
  variants::check_at_least(length, 1, fn, "length");
  variants::check_at_least(pattern.block, 1, fn, "pattern.block");
  variants::check_at_least(pattern.global_blocks, 0, fn, "pattern.global_blocks");
  variants::check_at_least(pattern.window_blocks, 0, fn, "pattern.window_blocks");
  variants::check_at_least(pattern.random_blocks, 0, fn, "pattern.random_blocks");
  BlockSparseLayout layout = empty_layout(length, pattern.block);
  const int64_t n = layout.query_blocks, g = std::min(pattern.global_blocks, n);
  std::vector<int64_t> cols;
  for (int64_t I = 0; I < n; ++I) {
    cols.clear();
    const int64_t end = causal ? I + 1 : n;  // key blocks [0, end) are allowed
    if (I < g) {  // a global query block sees everything allowed
      for (int64_t J = 0; J < end; ++J) cols.push_back(J);
      append_row(layout, cols);
      continue;
    }
    for (int64_t J = 0; J < std::min(g, end); ++J) cols.push_back(J);
    for (int64_t J = std::max<int64_t>(0, I - pattern.window_blocks); J < std::min(end, I + pattern.window_blocks + 1); ++J)
      cols.push_back(J);
    std::sort(cols.begin(), cols.end());
    cols.erase(std::unique(cols.begin(), cols.end()), cols.end());
    const std::vector<int64_t> extra = draw_blocks(cols, end, pattern.random_blocks, pattern.seed, uint64_t(I));
    cols.insert(cols.end(), extra.begin(), extra.end());
    append_row(layout, cols);
  }
  return layout;
}

Tensor block_sparse_mask(const BlockSparseLayout& layout, int64_t L, int64_t S, bool causal) {
  const std::string fn = "mha::block_sparse_mask";
  variants::check_at_least(L, 1, fn, "L");
  variants::check_at_least(S, 1, fn, "S");
  variants::check_layout(layout, L, S, fn, "layout");
  Tensor mask = Tensor::zeros({L, S}, DType::boolean);
  bool* m = mask.data<bool>();
  const int64_t b = layout.block;
  for (int64_t I = 0; I < layout.query_blocks && I * b < L; ++I)
    for (int64_t x = layout.row_begin[size_t(I)]; x < layout.row_begin[size_t(I) + 1]; ++x) {
      const int64_t J = layout.key_block[size_t(x)];
      for (int64_t i = I * b; i < std::min(L, (I + 1) * b); ++i)
        for (int64_t j = J * b; j < std::min(S, (J + 1) * b); ++j) m[i * S + j] = !causal || j <= i;
    }
  return mask;
}

}  // namespace mha
