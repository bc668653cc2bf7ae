// What ring attention and all-to-all (Ulysses) attention share: a rank's
// chunks of the padded sequence, the masks of blocks, the boundary checks.
#pragma once

#include <vector>

#include "mha/dist/ring_attention.h"

namespace mha::dist::detail {

int chunks_per_rank(RingLayout layout);
// The chunks rank q holds, in the order of its rows.
std::vector<int64_t> chunks_of(int q, int P, RingLayout layout);

struct Ring {
  int P = 1, r = 0;
  RingLayout layout = RingLayout::zigzag;
  int64_t length = 0, chunk = 0, rows = 0;  // chunk: positions a chunk; rows: a rank's
  std::vector<int64_t> mine;                 // this rank's chunks
};
Ring make_ring(const Communicator& comm, int64_t length, RingLayout layout);

// The mask of queries of chunk a against keys of chunk b (chunks of
// g.chunk positions): the user's mask's block (its leading dims kept) and the
// padding (positions ≥ g.length, masked both ways); undefined where neither
// applies. `user`: check_sequence_parallel's result.
Tensor block_mask(const Tensor& user, const Ring& g, int64_t a, int64_t b);

// The checks every call makes (fn names it); returns the user's mask
// contiguous, at least 2-D, bool or float64 (undefined without one).
Tensor check_sequence_parallel(const char* fn, const Communicator& comm, const Tensor& q, const Tensor& k,
                               const Tensor& v, const RingOptions& o);

// Backward's own inputs: dout defined and shaped like forward.out.
void check_backward_inputs(const char* fn, const Tensor& dout, const AttentionOutput& forward);

}  // namespace mha::dist::detail
