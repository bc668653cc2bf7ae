// All-to-all (DeepSpeed-Ulysses) attention: heads spread over the ranks for
// the whole sequence, between two all-to-alls (ring_attention.h).
#include <algorithm>

#include "check.h"
#include "dist/sequence_layout.h"
#include "mha/dist/ring_attention.h"

namespace mha::dist {
namespace {

using namespace detail;

Shape batch_dims(const Tensor& t) { return Shape(t.shape().begin(), t.shape().end() - 3); }

Shape with(Shape lead, std::initializer_list<int64_t> tail) {
  lead.insert(lead.end(), tail);
  return lead;
}

// (…, H, Lr, X), this rank's rows of every head → (…, H / P, P · Lr, X),
// every row of this rank's heads. Block d of the exchange holds head group d.
Tensor to_heads(Communicator& comm, const Tensor& t) {
  const int64_t P = comm.size(), H = t.size(-3), Lr = t.size(-2), X = t.size(-1), N = t.numel() / (H * Lr * X);
  const Tensor send = t.contiguous().view({N, P, H / P, Lr, X}).permute({1, 0, 2, 3, 4}).contiguous();
  Tensor receive = Tensor::empty({P, N, H / P, Lr, X}, t.dtype());
  comm.all_to_all(send.raw_data(), receive.raw_data(), send.numel() / P, t.dtype());
  return receive.permute({1, 2, 0, 3, 4}).reshape(with(batch_dims(t), {H / P, P * Lr, X}));
}

// The inverse: (…, H / P, Lp, X) → (…, H, Lp / P, X).
Tensor to_rows(Communicator& comm, const Tensor& t) {
  const int64_t P = comm.size(), h = t.size(-3), Lr = t.size(-2) / P, X = t.size(-1), N = t.numel() / (h * P * Lr * X);
  const Tensor send = t.contiguous().view({N, h, P, Lr, X}).permute({2, 0, 1, 3, 4}).contiguous();
  Tensor receive = Tensor::empty({P, N, h, Lr, X}, t.dtype());
  comm.all_to_all(send.raw_data(), receive.raw_data(), send.numel() / P, t.dtype());
  return receive.permute({1, 0, 2, 3, 4}).reshape(with(batch_dims(t), {P * h, Lr, X}));
}

Tensor lse_to_heads(Communicator& comm, const Tensor& lse) { return to_heads(comm, lse.unsqueeze(-1)).squeeze(-1); }
Tensor lse_to_rows(Communicator& comm, const Tensor& lse) { return to_rows(comm, lse.unsqueeze(-1)).squeeze(-1); }

// The whole padded sequence's options for this rank's heads: the user's mask
// (its heads dim, if it has one of Hq, cut to this rank's) and the padding.
AttentionOptions whole_sequence(const Communicator& comm, const Tensor& user, const RingOptions& o, int64_t Hq) {
  Ring whole = make_ring(comm, o.length, RingLayout::contiguous);
  whole.chunk = whole.rows * whole.P;  // one chunk: the padded sequence
  AttentionOptions a;
  a.mask = block_mask(user, whole, 0, 0);
  if (a.mask.defined() && a.mask.dim() >= 3 && a.mask.size(-3) == Hq && Hq > 1) {
    const int64_t h = Hq / comm.size(), d = a.mask.dim() - 3;
    a.mask = a.mask.slice(d, comm.rank() * h, (comm.rank() + 1) * h);
  }
  a.causal = o.causal;
  a.scale = o.scale;
  return a;
}

Tensor check_ulysses(const char* fn, const Communicator& comm, const Tensor& q, const Tensor& k, const Tensor& v,
                     const RingOptions& o) {
  const Tensor mask = check_sequence_parallel(fn, comm, q, k, v, o);
  if (o.layout != RingLayout::contiguous)
    raise<ValueError>(fn, "options.layout", "contiguous (all-to-all attention takes whole rows)", "zigzag");
  for (const auto& [t, name] : {std::pair{&q, "query"}, {&k, "key"}})
    if (t->size(-3) % comm.size() != 0)
      raise<ShapeError>(fn, name, "a number of heads that the " + std::to_string(comm.size()) + " ranks divide",
                        std::to_string(t->size(-3)) + " heads");
  return mask;
}

RingWork work_of(const Communicator& comm, const RingOptions& o, int64_t sent) {
  const int64_t Lp = ring_block_length(o.length, comm.size(), RingLayout::contiguous) * comm.size();
  const int64_t pairs = o.causal == Causal::none ? Lp * Lp : Lp * (Lp + 1) / 2;
  return {.pairs = pairs / comm.size(), .blocks = 1, .bytes_sent = sent};
}

}  // namespace

AttentionOutput ulysses_attention_forward(Communicator& comm, const Tensor& query, const Tensor& key,
                                          const Tensor& value, const RingOptions& options) {
  const Tensor user = check_ulysses("mha::dist::ulysses_attention_forward", comm, query, key, value, options);
  const int64_t sent_before = comm.bytes_sent();
  const AttentionOutput heads =
      attention_forward(to_heads(comm, query), to_heads(comm, key), to_heads(comm, value),
                        whole_sequence(comm, user, options, query.size(-3)));
  AttentionOutput out;
  out.out = to_rows(comm, heads.out), out.lse = lse_to_rows(comm, heads.lse), out.path = heads.path;
  if (options.work) *options.work = work_of(comm, options, comm.bytes_sent() - sent_before);
  return out;
}

AttentionGradients ulysses_attention_backward(Communicator& comm, const Tensor& dout, const Tensor& query,
                                              const Tensor& key, const Tensor& value,
                                              const AttentionOutput& forward, const RingOptions& options) {
  const char* fn = "mha::dist::ulysses_attention_backward";
  const Tensor user = check_ulysses(fn, comm, query, key, value, options);
  check_backward_inputs(fn, dout, forward);
  const int64_t sent_before = comm.bytes_sent();
  AttentionOutput heads;
  heads.out = to_heads(comm, forward.out), heads.lse = lse_to_heads(comm, forward.lse), heads.path = forward.path;
  const AttentionGradients g =
      attention_backward(to_heads(comm, dout), to_heads(comm, query), to_heads(comm, key), to_heads(comm, value),
                         heads, whole_sequence(comm, user, options, query.size(-3)));
  AttentionGradients rows;
  rows.dquery = to_rows(comm, g.dquery), rows.dkey = to_rows(comm, g.dkey), rows.dvalue = to_rows(comm, g.dvalue);
  if (options.work) *options.work = work_of(comm, options, comm.bytes_sent() - sent_before);
  return rows;
}

}  // namespace mha::dist
