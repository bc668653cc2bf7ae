// Ring attention against attention over the whole sequence in one process:
// ctest runs this program under mpirun -np 2, 3 and 4 (and once alone). Every
// rank draws the same inputs, runs its rows through the ring, and gathers the
// rows back to compare the output, lse and every gradient.
#include <gtest/gtest.h>

#include <cmath>

#include "mha/dist/ring_attention.h"
#include "mha/errors.h"
#include "testing.h"

namespace mha {
namespace {

using dist::RingLayout;
using namespace testing;

dist::Communicator& comm() { return dist::world(); }

std::string describe(RingLayout l) { return l == RingLayout::zigzag ? "zigzag" : "contiguous"; }

// Largest difference where both are finite; -inf (fully masked rows) must
// sit at the same places in both.
double lse_difference(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector(), y = b.to_vector();
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isinf(x[i]) || std::isinf(y[i])) {
      if (x[i] != y[i]) return INFINITY;
      continue;
    }
    worst = std::max(worst, std::abs(x[i] - y[i]));
  }
  return worst;
}

enum class MaskKind { none, boolean, additive };

struct Case {
  int64_t L;
  bool causal;
  RingLayout layout;
  MaskKind mask;
  int64_t Hq, Hk;
  DType dtype;
  bool ulysses = false;  // all-to-all attention instead of the ring
};

std::string describe(const Case& c) {
  const char* masks[] = {"no mask", "bool mask", "additive mask"};
  return std::string(c.ulysses ? "all-to-all " : "ring ") + "L " + std::to_string(c.L) + (c.causal ? " causal " : " ") + describe(c.layout) + " " +
         masks[int(c.mask)] + " Hq " + std::to_string(c.Hq) + " Hk " + std::to_string(c.Hk) + " " +
         to_string(c.dtype);
}

// A mask over (B, 1, L, L) with some rows fully masked, as bool or additive.
Tensor make_mask(MaskKind kind, int64_t B, int64_t L, DType dtype) {
  if (kind == MaskKind::none) return {};
  const Tensor noise = random_tensor({B, 1, L, L}, 77, DType::float64);
  std::vector<double> u = noise.to_vector();
  std::vector<bool> keep(u.size());
  std::vector<double> add(u.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < L; ++j) {
        const size_t at = size_t((b * L + i) * L + j);
        const bool dead_row = (i % 5 == 3);  // every fifth row sees nothing
        keep[at] = !dead_row && u[at] > -0.8;
        add[at] = keep[at] ? 0.5 * u[at] : -INFINITY;
      }
  if (kind == MaskKind::boolean) return Tensor::from_bools(keep, {B, 1, L, L});
  return Tensor::from_values(add, {B, 1, L, L}, dtype);
}

void check_case(const Case& c) {
  SCOPED_TRACE(describe(c) + " on " + std::to_string(comm().size()) + " ranks");
  const int64_t B = 2, E = 8, Ev = 5;
  const Tensor q = random_tensor({B, c.Hq, c.L, E}, 1, c.dtype), k = random_tensor({B, c.Hk, c.L, E}, 2, c.dtype);
  const Tensor v = random_tensor({B, c.Hk, c.L, Ev}, 3, c.dtype), dout = random_tensor({B, c.Hq, c.L, Ev}, 4, c.dtype);
  const Tensor mask = make_mask(c.mask, B, c.L, c.dtype);
  AttentionOptions whole;
  whole.mask = mask;
  whole.causal = c.causal ? Causal::top_left : Causal::none;
  const AttentionOutput want = attention_forward(q, k, v, whole);
  const AttentionGradients want_grads = attention_backward(dout, q, k, v, want, whole);

  dist::RingOptions ring;
  ring.layout = c.layout, ring.length = c.L, ring.mask = mask, ring.causal = whole.causal;
  dist::RingWork work;
  ring.work = &work;
  const auto shard = [&](const Tensor& t) { return dist::ring_shard(t, comm(), c.layout); };
  const Tensor ql = shard(q), kl = shard(k), vl = shard(v), dl = shard(dout);
  const AttentionOutput got = c.ulysses ? dist::ulysses_attention_forward(comm(), ql, kl, vl, ring)
                                        : dist::ring_attention_forward(comm(), ql, kl, vl, ring);
  const AttentionGradients got_grads = c.ulysses ? dist::ulysses_attention_backward(comm(), dl, ql, kl, vl, got, ring)
                                                 : dist::ring_attention_backward(comm(), dl, ql, kl, vl, got, ring);
  const auto whole_of = [&](const Tensor& t) { return dist::ring_unshard(t, c.L, comm(), c.layout); };

  const double tol = c.dtype == DType::float64 ? 1e-12 : 1e-5;
  EXPECT_LE(max_abs_diff(whole_of(got.out), want.out), tol);
  EXPECT_LE(lse_difference(whole_of(got.lse.unsqueeze(-1)).squeeze(-1), want.lse), tol);
  EXPECT_LE(max_abs_diff(whole_of(got_grads.dquery), want_grads.dquery), tol);
  EXPECT_LE(max_abs_diff(whole_of(got_grads.dkey), want_grads.dkey), tol);
  EXPECT_LE(max_abs_diff(whole_of(got_grads.dvalue), want_grads.dvalue), tol);
  EXPECT_TRUE(all_finite(got.out));
  EXPECT_TRUE(all_finite(got_grads.dquery) && all_finite(got_grads.dkey) && all_finite(got_grads.dvalue));
  EXPECT_GT(work.blocks, 0);
}

TEST(RingAttention, EqualsAttentionOverTheWholeSequence) {
  for (DType dtype : {DType::float32, DType::float64})
    for (RingLayout layout : {RingLayout::zigzag, RingLayout::contiguous})
      for (bool causal : {true, false})
        for (int64_t L : {1, 13, 40})
          check_case({L, causal, layout, MaskKind::none, 4, 4, dtype});
}

TEST(RingAttention, MasksFullyMaskedRowsAndGroupedQueries) {
  for (DType dtype : {DType::float32, DType::float64})
    for (RingLayout layout : {RingLayout::zigzag, RingLayout::contiguous})
      for (MaskKind mask : {MaskKind::boolean, MaskKind::additive})
        for (bool causal : {true, false}) {
          check_case({21, causal, layout, mask, 4, 2, dtype});
          check_case({7, causal, layout, mask, 2, 1, dtype});
        }
}

// All-to-all attention: 12 or 24 query heads and 12 key heads, which 1, 2, 3 and 4 ranks divide.
TEST(UlyssesAttention, EqualsAttentionOverTheWholeSequence) {
  for (DType dtype : {DType::float32, DType::float64})
    for (bool causal : {true, false})
      for (MaskKind mask : {MaskKind::none, MaskKind::boolean, MaskKind::additive})
        for (int64_t L : {1, 13, 29}) {
          check_case({L, causal, RingLayout::contiguous, mask, 12, 12, dtype, true});
          check_case({L, causal, RingLayout::contiguous, mask, 24, 12, dtype, true});
        }
}

TEST(UlyssesAttention, RefusesWhatItCannotSplit) {
  const int P = comm().size();
  const int64_t rows = dist::ring_block_length(10, P, RingLayout::contiguous);
  dist::RingOptions ring;
  ring.length = 10, ring.layout = RingLayout::contiguous;
  const Tensor q = Tensor::zeros({1, 12, rows, 4});
  if (P > 1) {
    const Tensor odd = Tensor::zeros({1, 12 * P + 1, rows, 4});
    expect_error<ShapeError>([&] { dist::ulysses_attention_forward(comm(), odd, odd, odd, ring); },
                             {"mha::dist::ulysses_attention_forward", "query", "heads"});
  }
  ring.layout = RingLayout::zigzag;
  const Tensor z = Tensor::zeros({1, 12, dist::ring_block_length(10, P, RingLayout::zigzag), 4});
  expect_error<ValueError>([&] { dist::ulysses_attention_forward(comm(), z, z, z, ring); }, {"options.layout"});
}

// Zigzag gives every rank the same causal work; contiguous about (2P − 1) / P
// of the mean to the last rank.
TEST(RingAttention, ZigzagBalancesCausalWork) {
  const int P = comm().size();
  const int64_t L = 48 * P;
  for (RingLayout layout : {RingLayout::zigzag, RingLayout::contiguous}) {
    const Tensor q = dist::ring_shard(random_tensor({1, 2, L, 8}, 5, DType::float32), comm(), layout);
    dist::RingOptions ring;
    ring.layout = layout, ring.length = L, ring.causal = Causal::top_left;
    dist::RingWork work;
    ring.work = &work;
    dist::ring_attention_forward(comm(), q, q, q, ring);
    std::vector<int64_t> pairs(static_cast<size_t>(P));
    comm().all_gather(&work.pairs, pairs.data(), 1, DType::int64);
    const double mean = double(L) * double(L + 1) / 2 / P;
    const double most = double(*std::max_element(pairs.begin(), pairs.end()));
    double sum = 0;
    for (int64_t p : pairs) sum += double(p);
    EXPECT_EQ(sum, double(L) * double(L + 1) / 2) << describe(layout);
    if (layout == RingLayout::zigzag) EXPECT_LE(most / mean, 1.10);
    else EXPECT_NEAR(most / mean, (2.0 * P - 1) / P, 0.05);
  }
}

TEST(RingAttention, LayoutsPlaceEveryPositionOnce) {
  for (int P : {1, 2, 3, 4})
    for (RingLayout layout : {RingLayout::zigzag, RingLayout::contiguous})
      for (int64_t L : {1, 5, 16, 17}) {
        std::vector<int> seen(size_t(dist::ring_block_length(L, P, layout) * P), 0);
        for (int r = 0; r < P; ++r)
          for (int64_t p : dist::ring_positions(L, r, P, layout)) ++seen[size_t(p)];
        for (int n : seen) EXPECT_EQ(n, 1);
      }
  // Zigzag on 2 ranks, 8 positions: rank 0 holds chunks 0 and 3.
  EXPECT_EQ(dist::ring_positions(8, 0, 2, RingLayout::zigzag), (std::vector<int64_t>{0, 1, 6, 7}));
}

TEST(RingAttention, RefusesBadInput) {
  const int64_t rows = dist::ring_block_length(10, comm().size(), RingLayout::zigzag);
  const Tensor q = Tensor::zeros({1, 2, rows, 4});
  dist::RingOptions ring;
  ring.length = 10;
  expect_error<ShapeError>([&] { dist::ring_attention_forward(comm(), Tensor::zeros({1, 2, rows + 1, 4}), q, q, ring); },
                           {"mha::dist::ring_attention_forward", "query", "rows"});
  expect_error<DtypeError>(
      [&] { dist::ring_attention_forward(comm(), q.to(DType::bfloat16), q, q, ring); }, {"float32 or float64"});
  ring.causal = Causal::bottom_right;
  expect_error<ValueError>([&] { dist::ring_attention_forward(comm(), q, q, q, ring); }, {"options.causal"});
  ring.causal = Causal::none, ring.length = 0;
  expect_error<ValueError>([&] { dist::ring_attention_forward(comm(), q, q, q, ring); }, {"options.length"});
  ring.length = 10, ring.mask = Tensor::zeros({3, 10});
  expect_error<ShapeError>([&] { dist::ring_attention_forward(comm(), q, q, q, ring); }, {"options.mask"});
}

}  // namespace
}  // namespace mha
