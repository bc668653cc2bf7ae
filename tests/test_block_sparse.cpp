// Block-sparse attention: equal to attention_forward/backward with the
// layout's dense mask (strided and BigBird patterns, causal or not, odd sizes,
// partial last blocks, L != S), finite-difference gradients in double, rows
// that see nothing, the layouts themselves, and the typed errors.
#include "mha/variants/block_sparse.h"
#include "variants_testing.h"

using namespace mha;
using namespace mha::testing;

namespace {

struct Case {
  std::string name;
  Shape q, k, v;
  BlockSparseOptions options;
};

// The block-sparse result against the reference path with the dense mask:
// out, lse and the three gradients, in float64 (tight) and float32.
void compare_with_dense(const Case& c) {
  SCOPED_TRACE(c.name);
  const int64_t L = c.q[c.q.size() - 2], S = c.k[c.k.size() - 2];
  const AttentionOptions dense{.mask = block_sparse_mask(c.options.layout, L, S, c.options.causal),
                               .scale = c.options.scale, .path = AttentionPath::reference};
  for (DType dtype : {DType::float64, DType::float32}) {
    Tensor q = random_tensor(c.q, 1, dtype), k = random_tensor(c.k, 2, dtype), v = random_tensor(c.v, 3, dtype);
    const double tol = dtype == DType::float64 ? 1e-12 : 2e-5;
    BlockSparseOutput a = block_sparse_attention_forward(q, k, v, c.options);
    AttentionOutput b = attention_forward(q, k, v, dense);
    EXPECT_LT(max_abs_diff(a.out, b.out), tol) << to_string(dtype);
    std::vector<double> la = a.lse.to_vector(), lb = b.lse.to_vector();
    for (size_t i = 0; i < la.size(); ++i) {
      if (std::isinf(lb[i])) EXPECT_EQ(la[i], lb[i]) << "row " << i;
      else EXPECT_NEAR(la[i], lb[i], 10 * tol) << "row " << i;
    }
    Tensor dout = random_tensor(a.out.shape(), 4, dtype);
    AttentionGradients ga = block_sparse_attention_backward(dout, q, k, v, a, c.options);
    AttentionGradients gb = attention_backward(dout, q, k, v, b, dense);
    EXPECT_LT(max_abs_diff(ga.dquery, gb.dquery), 10 * tol) << "dquery " << to_string(dtype);
    EXPECT_LT(max_abs_diff(ga.dkey, gb.dkey), 10 * tol) << "dkey " << to_string(dtype);
    EXPECT_LT(max_abs_diff(ga.dvalue, gb.dvalue), 10 * tol) << "dvalue " << to_string(dtype);
  }
}

void check_gradients(const Case& c) {
  Tensor q = random_tensor(c.q, 11), k = random_tensor(c.k, 12), v = random_tensor(c.v, 13);
  BlockSparseOutput fwd = block_sparse_attention_forward(q, k, v, c.options);
  Tensor r = random_tensor(fwd.out.shape(), 14);
  AttentionGradients g = block_sparse_attention_backward(r, q, k, v, fwd, c.options);
  expect_gradients(c.name, r, [&] { return block_sparse_attention_forward(q, k, v, c.options).out; },
                   {{"dq", q, g.dquery}, {"dk", k, g.dkey}, {"dv", v, g.dvalue}});
}

// A layout given row by row (for L != S and for empty rows).
BlockSparseLayout layout_of(int64_t block, int64_t key_blocks, const std::vector<std::vector<int64_t>>& rows) {
  BlockSparseLayout lay{.block = block, .query_blocks = int64_t(rows.size()), .key_blocks = key_blocks, .row_begin = {0}};
  for (const auto& row : rows) {
    lay.key_block.insert(lay.key_block.end(), row.begin(), row.end());
    lay.row_begin.push_back(int64_t(lay.key_block.size()));
  }
  return lay;
}

}  // namespace

TEST(BlockSparse, StridedEqualsDenseMask) {
  const StridedPattern pattern{.block = 8, .local_blocks = 2, .stride_blocks = 3};
  compare_with_dense({"strided", {2, 3, 37, 5}, {2, 3, 37, 5}, {2, 3, 37, 3}, {.layout = strided_layout(37, pattern)}});
  compare_with_dense({"strided causal", {2, 3, 37, 5}, {2, 3, 37, 5}, {2, 3, 37, 3},
                      {.layout = strided_layout(37, pattern, true), .causal = true}});
}

TEST(BlockSparse, BigBirdEqualsDenseMask) {
  const BigBirdPattern pattern{.block = 4, .global_blocks = 1, .window_blocks = 1, .random_blocks = 2, .seed = 9};
  compare_with_dense({"bigbird", {2, 2, 41, 6}, {2, 2, 41, 6}, {2, 2, 41, 4}, {.layout = bigbird_layout(41, pattern)}});
  compare_with_dense({"bigbird causal, scale 0.7", {3, 41, 6}, {3, 41, 6}, {3, 41, 4},
                      {.layout = bigbird_layout(41, pattern, true), .causal = true, .scale = 0.7}});
}

TEST(BlockSparse, QueryAndKeyLengthsDiffer) {
  // L = 11 (3 blocks of 4), S = 18 (5 blocks); a causal mask leaves the first rows few keys.
  const BlockSparseLayout lay = layout_of(4, 5, {{0, 4}, {1, 2}, {0, 2, 3}});
  compare_with_dense({"L=11 S=18", {2, 11, 3}, {2, 18, 3}, {2, 18, 2}, {.layout = lay}});
  compare_with_dense({"L=11 S=18 causal", {2, 11, 3}, {2, 18, 3}, {2, 18, 2}, {.layout = lay, .causal = true}});
}

TEST(BlockSparse, FiniteDifferenceGradients) {
  check_gradients({"strided L=13 block 4", {2, 13, 3}, {2, 13, 3}, {2, 13, 2},
                   {.layout = strided_layout(13, {.block = 4, .local_blocks = 1, .stride_blocks = 2})}});
  check_gradients({"bigbird causal L=13 block 3", {2, 13, 3}, {2, 13, 3}, {2, 13, 2},
                   {.layout = bigbird_layout(13, {.block = 3, .random_blocks = 1, .seed = 4}, true), .causal = true}});
  check_gradients({"L=7 S=9, custom", {7, 3}, {9, 3}, {9, 5}, {.layout = layout_of(3, 3, {{0, 2}, {1}, {0, 1, 2}})}});
}

TEST(BlockSparse, RowsThatSeeNothingAndLengthOne) {
  // Query block 1 has no key blocks; causal leaves row 0 of block 2 without its only block's keys.
  const BlockSparseLayout lay = layout_of(3, 3, {{0}, {}, {2}});
  for (bool causal : {false, true}) {
    Tensor q = random_tensor({2, 8, 4}, 1), k = random_tensor({2, 8, 4}, 2), v = random_tensor({2, 8, 3}, 3);
    const BlockSparseOptions o{.layout = lay, .causal = causal};
    BlockSparseOutput f = block_sparse_attention_forward(q, k, v, o);
    EXPECT_TRUE(all_finite(f.out));
    for (int64_t i = 3; i < 6; ++i) {
      EXPECT_EQ(f.lse.item({1, i}), -INFINITY);
      EXPECT_EQ(f.out.item({1, i, 0}), 0.0);
    }
    AttentionGradients g = block_sparse_attention_backward(random_tensor({2, 8, 3}, 4), q, k, v, f, o);
    EXPECT_TRUE(all_finite(g.dquery) && all_finite(g.dkey) && all_finite(g.dvalue));
    EXPECT_EQ(g.dquery.item({0, 4, 0}), 0.0);
  }
  for (bool causal : {false, true}) {  // L = S = 1
    Tensor q = random_tensor({1, 2}, 5), k = random_tensor({1, 2}, 6), v = random_tensor({1, 3}, 7);
    const BlockSparseOptions o{.layout = bigbird_layout(1, {}, causal), .causal = causal};
    BlockSparseOutput f = block_sparse_attention_forward(q, k, v, o);
    EXPECT_LT(max_abs_diff(f.out, v), 1e-15);
    AttentionGradients g = block_sparse_attention_backward(random_tensor({1, 3}, 8), q, k, v, f, o);
    EXPECT_TRUE(all_finite(g.dquery) && all_finite(g.dkey) && all_finite(g.dvalue));
  }
}

TEST(BlockSparse, Layouts) {
  // Strided, 10 blocks, local 2, stride 4: row 5 sees 4, 5, 6 (local) and 1, 5, 9 (stride).
  const BlockSparseLayout s = strided_layout(80, {.block = 8, .local_blocks = 2, .stride_blocks = 4});
  std::vector<int64_t> row5(s.key_block.begin() + s.row_begin[5], s.key_block.begin() + s.row_begin[6]);
  EXPECT_EQ(row5, (std::vector<int64_t>{1, 4, 5, 6, 9}));
  const BlockSparseLayout sc = strided_layout(80, {.block = 8, .local_blocks = 2, .stride_blocks = 4}, true);
  std::vector<int64_t> row5c(sc.key_block.begin() + sc.row_begin[5], sc.key_block.begin() + sc.row_begin[6]);
  EXPECT_EQ(row5c, (std::vector<int64_t>{1, 4, 5}));
  // BigBird: global block 0 row sees all; other rows: block 0, the window, and `random` others.
  const BigBirdPattern pattern{.block = 16, .global_blocks = 1, .window_blocks = 1, .random_blocks = 3, .seed = 1};
  const BlockSparseLayout a = bigbird_layout(1024, pattern), b = bigbird_layout(1024, pattern);
  EXPECT_EQ(a.key_block, b.key_block);  // the seed fixes the draw
  EXPECT_EQ(a.row_begin[1], 64);
  for (int64_t I = 2; I < 63; ++I) EXPECT_EQ(a.row_begin[size_t(I) + 1] - a.row_begin[size_t(I)], 1 + 3 + 3) << I;
  BigBirdPattern other = pattern;
  other.seed = 2;
  EXPECT_NE(bigbird_layout(1024, other).key_block, a.key_block);
  // Causal rows never look ahead; a short row takes every block it may.
  const BlockSparseLayout c = bigbird_layout(1024, pattern, true);
  for (int64_t I = 0; I < c.query_blocks; ++I)
    for (int64_t x = c.row_begin[size_t(I)]; x < c.row_begin[size_t(I) + 1]; ++x) EXPECT_LE(c.key_block[size_t(x)], I);
  EXPECT_EQ(c.row_begin[4] - c.row_begin[3], 4);  // row 3: blocks 0, 1, 2, 3
  // The cost is linear in L: n blocks (the global row) + 6 + 7·(n - 3) + 6 = 8n - 9.
  EXPECT_EQ(bigbird_layout(1 << 14, pattern).nonzero_blocks(), 8 * 1024 - 9);
  EXPECT_EQ(bigbird_layout(1 << 15, pattern).nonzero_blocks(), 8 * 2048 - 9);
}

TEST(BlockSparse, Errors) {
  Tensor q = random_tensor({2, 10, 4}, 1), k = random_tensor({2, 10, 4}, 2), v = random_tensor({2, 10, 3}, 3);
  const BlockSparseOptions o{.layout = strided_layout(10, {.block = 4})};
  expect_error<ValueError>([&] { block_sparse_attention_forward(q, k, v, {.layout = strided_layout(13, {.block = 4})}); },
         "[mha::block_sparse_attention_forward] options.layout: expected 3 x 3 blocks of 4 for L = 10, S = 10; got 4 x 4");
  expect_error<DtypeError>([&] { block_sparse_attention_forward(q, k.to(DType::float32), v, o); },
         "[mha::block_sparse_attention_forward] key: expected query's dtype float64; got float32");
  expect_error<DtypeError>([&] { block_sparse_attention_forward(q.to(DType::bfloat16), k, v, o); }, "query: expected float32 or float64; got bfloat16");
  expect_error<ShapeError>([&] { block_sparse_attention_forward(q, random_tensor({3, 10, 4}, 1), v, o); },
         "key: expected the leading dims (2,) of query (2, 10, 4); got (3, 10, 4)");
  expect_error<ShapeError>([&] { block_sparse_attention_forward(q, k, random_tensor({2, 9, 3}, 1), o); }, "value: expected dim -2 S = 10 (key's)");
  BlockSparseOptions unsorted = o;
  std::swap(unsorted.layout.key_block[0], unsorted.layout.key_block[1]);
  expect_error<ValueError>([&] { block_sparse_attention_forward(q, k, v, unsorted); }, "options.layout.key_block: expected strictly ascending");
  expect_error<ValueError>([&] { strided_layout(10, {.block = 0}); }, "[mha::strided_layout] pattern.block: expected >= 1; got 0");
  expect_error<ValueError>([&] { bigbird_layout(10, {.random_blocks = -1}); }, "[mha::bigbird_layout] pattern.random_blocks: expected >= 0; got -1");
  BlockSparseOutput f = block_sparse_attention_forward(q, k, v, o);
  expect_error<ShapeError>([&] { block_sparse_attention_backward(random_tensor({2, 10, 4}, 1), q, k, v, f, o); },
         "[mha::block_sparse_attention_backward] dout: expected shape (2, 10, 3); got (2, 10, 4)");
  expect_error<ShapeError>([&] { block_sparse_attention_backward(f.out, q, k, v, {f.out, Tensor()}, o); }, "forward.lse: expected a defined tensor");
}
