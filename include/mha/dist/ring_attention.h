// Ring attention (Liu et al. 2023): self-attention over one sequence whose
// positions are spread over the ranks of a communicator.
//
// The sequence, padded to Lp positions (a multiple of the chunk count), is
// cut into equal chunks: P chunks, rank r holding chunk r (contiguous), or 2P
// chunks, rank r holding chunks r and 2P − 1 − r (zigzag: under a causal mask
// every rank then has the same number of visible pairs). Each rank keeps its
// queries; keys and values travel around the ring, and in step t rank r
// attends to the block of rank r − t with the fused kernel while the next
// block is on its way (Communicator::start). The blocks' partial outputs merge
// through their log-sum-exp: lse = log(e^lse_a + e^lse_b), out = e^(lse_a −
// lse) out_a + e^(lse_b − lse) out_b (a row no block lets see anything: out 0,
// lse −inf). Backward sends dK and dV around the ring behind K and V, each
// rank adding its share with the global out and lse, and home at the end.
// Padding positions (≥ length) are masked as keys and give 0 as queries.
#pragma once

#include <cstdint>

#include "mha/attention.h"
#include "mha/dist/communicator.h"

namespace mha::dist {

enum class RingLayout : uint8_t { contiguous, zigzag };

// What a rank computed: (query, key) pairs its kernels ran over (visible by
// causality; per head: all-to-all attention counts its share of the heads),
// blocks attended, and the bytes it sent.
struct RingWork {
  int64_t pairs = 0, blocks = 0, bytes_sent = 0;
};

struct RingOptions {
  RingLayout layout = RingLayout::zigzag;
  int64_t length = 0;            // the sequence's real length L (≥ 1)
  Causal causal = Causal::none;  // none or top_left (query i sees keys j ≤ i)
  // Broadcastable to (…, Hq, L, L) over the real positions, bool (true =
  // may attend) or additive, the same on every rank; undefined: none.
  Tensor mask;
  std::optional<double> scale;  // default 1/sqrt(E)
  RingWork* work = nullptr;     // where given: filled by the call
};

// Positions per rank: Lp / P, Lp the length padded to a multiple of P
// (contiguous) or 2P (zigzag).
int64_t ring_block_length(int64_t length, int ranks, RingLayout layout);
// The sequence positions of rank's rows, in order (padding included: ≥ length).
std::vector<int64_t> ring_positions(int64_t length, int rank, int ranks, RingLayout layout);
// The rows of `full` (…, L, X) that this rank holds, (…, Lp / P, X) with
// zeros at padding positions; and back: every rank's rows gathered into the
// whole (…, L, X) sequence (all_gather).
Tensor ring_shard(const Tensor& full, Communicator& comm, RingLayout layout);
Tensor ring_unshard(const Tensor& rows, int64_t length, Communicator& comm, RingLayout layout);

// query (…, Hq, Lp/P, E), key (…, Hk, Lp/P, E), value (…, Hk, Lp/P, Ev):
// this rank's rows (ring_shard), float32 or float64; the leading dims equal
// but for the heads (Hk divides Hq: grouped-query). Returns this rank's out
// (…, Hq, Lp/P, Ev) and lse (…, Hq, Lp/P) (float32, or float64 for float64),
// as attention_forward over the whole sequence would give for these rows.
AttentionOutput ring_attention_forward(Communicator& comm, const Tensor& query, const Tensor& key,
                                       const Tensor& value, const RingOptions& options);
// dout: this rank's rows of the output's gradient; forward: what
// ring_attention_forward returned. The gradients of this rank's rows.
AttentionGradients ring_attention_backward(Communicator& comm, const Tensor& dout, const Tensor& query,
                                           const Tensor& key, const Tensor& value, const AttentionOutput& forward,
                                           const RingOptions& options);

// All-to-all attention (DeepSpeed-Ulysses) over the contiguous layout's rows
// (options.layout must be contiguous): an all-to-all turns this rank's rows of
// every head into every row of its Hq / P query heads (and Hk / P key and
// value heads), the fused kernel runs over the whole sequence there, and a
// second all-to-all brings the output rows back. Needs P to divide Hq and Hk.
// Each rank sends (P − 1) / P of its q, k, v and out (backward: of dout, q, k,
// v, out, lse there and of dq, dk, dv back). Same arguments and results as the ring's.
AttentionOutput ulysses_attention_forward(Communicator& comm, const Tensor& query, const Tensor& key,
                                          const Tensor& value, const RingOptions& options);
AttentionGradients ulysses_attention_backward(Communicator& comm, const Tensor& dout, const Tensor& query,
                                              const Tensor& key, const Tensor& value,
                                              const AttentionOutput& forward, const RingOptions& options);

}  // namespace mha::dist
