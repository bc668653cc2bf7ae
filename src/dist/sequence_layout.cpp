// Sequence layouts over ranks (contiguous, zigzag), the shards of a
// sequence and their gathering, the masks of blocks, and the checks that ring
// and all-to-all attention share.
#include "dist/sequence_layout.h"

#include <algorithm>
#include <cmath>

#include "check.h"

namespace mha::dist {
namespace detail {

int chunks_per_rank(RingLayout layout) { return layout == RingLayout::zigzag ? 2 : 1; }

std::vector<int64_t> chunks_of(int q, int P, RingLayout layout) {
  if (layout == RingLayout::contiguous) return {q};
  return {q, 2 * int64_t(P) - 1 - q};
}

Ring make_ring(const Communicator& comm, int64_t length, RingLayout layout) {
  Ring g;
  g.P = comm.size(), g.r = comm.rank(), g.layout = layout, g.length = length;
  g.rows = ring_block_length(length, g.P, layout);
  g.chunk = g.rows / chunks_per_rank(layout);
  g.mine = chunks_of(g.r, g.P, layout);
  return g;
}

Tensor block_mask(const Tensor& user, const Ring& g, int64_t a, int64_t b) {
  const int64_t c = g.chunk, q0 = a * c, k0 = b * c;
  const bool padded = q0 + c > g.length || k0 + c > g.length;
  if (!user.defined() && !padded) return {};
  const bool as_bool = !user.defined() || user.dtype() == DType::boolean;
  Shape shape = user.defined() ? Shape(user.shape().begin(), user.shape().end() - 2) : Shape{};
  const int64_t lead = shape_numel(shape);
  shape.push_back(c), shape.push_back(c);
  Tensor out = Tensor::empty(shape, as_bool ? DType::boolean : DType::float64);
  const int64_t Lm = user.defined() ? user.size(-2) : 1, Sm = user.defined() ? user.size(-1) : 1;
  for (int64_t m = 0; m < lead; ++m)
    for (int64_t i = 0; i < c; ++i)
      for (int64_t j = 0; j < c; ++j) {
        const int64_t qi = q0 + i, kj = k0 + j, at = (m * c + i) * c + j;
        const bool real = qi < g.length && kj < g.length;
        const int64_t from = (m * Lm + (Lm == 1 ? 0 : qi)) * Sm + (Sm == 1 ? 0 : kj);
        if (as_bool) out.data<bool>()[at] = real && (!user.defined() || user.data<bool>()[from]);
        else out.data<double>()[at] = real ? user.data<double>()[from] : -INFINITY;
      }
  return out;
}

Tensor check_sequence_parallel(const char* fn, const Communicator& comm, const Tensor& q, const Tensor& k, const Tensor& v,
                  const RingOptions& o) {
  if (o.length < 1) raise<ValueError>(fn, "options.length", ">= 1", std::to_string(o.length));
  if (o.causal == Causal::bottom_right)
    raise<ValueError>(fn, "options.causal", "none or top_left (self-attention over one sequence)", "bottom_right");
  for (const auto& [t, name] : {std::pair{&q, "query"}, {&k, "key"}, {&v, "value"}}) {
    check_defined(*t, fn, name);
    if (t->dim() < 3) raise<ShapeError>(fn, name, "(…, heads, rows, features)", shape_string(t->shape()));
    if (t->dtype() != DType::float32 && t->dtype() != DType::float64)
      raise<DtypeError>(fn, name, "float32 or float64", to_string(t->dtype()));
    if (t->dtype() != q.dtype()) raise<DtypeError>(fn, name, "query's " + to_string(q.dtype()), to_string(t->dtype()));
    const int64_t rows = ring_block_length(o.length, comm.size(), o.layout);
    if (t->size(-2) != rows)
      raise<ShapeError>(fn, name, std::to_string(rows) + " rows (this rank's of a sequence of " +
                                      std::to_string(o.length) + " over " + std::to_string(comm.size()) + " ranks)",
                        shape_string(t->shape()));
  }
  if (k.dim() != v.dim() || !std::equal(k.shape().begin(), k.shape().end() - 1, v.shape().begin()))
    raise<ShapeError>(fn, "value", "key's dims but the last, " + shape_string(k.shape()), shape_string(v.shape()));
  if (k.dim() != q.dim() || !std::equal(q.shape().begin(), q.shape().end() - 3, k.shape().begin()))
    raise<ShapeError>(fn, "key", "query's batch dims (all before heads, rows, features) " + shape_string(q.shape()),
                      shape_string(k.shape()));
  if (!o.mask.defined()) return {};
  Tensor m = o.mask.dim() == 1 ? o.mask.unsqueeze(0) : o.mask;
  for (int64_t d : {-2, -1})
    if (m.size(d) != 1 && m.size(d) != o.length)
      raise<ShapeError>(fn, "options.mask", "(…, L or 1, L or 1) with L = " + std::to_string(o.length),
                        shape_string(o.mask.shape()));
  return m.dtype() == DType::boolean ? m.contiguous() : m.to(DType::float64).contiguous();
}

void check_backward_inputs(const char* fn, const Tensor& dout, const AttentionOutput& forward) {
  check_defined(dout, fn, "dout");
  check_defined(forward.out, fn, "forward.out");
  if (dout.shape() != forward.out.shape())
    raise<ShapeError>(fn, "dout", "forward.out's shape " + shape_string(forward.out.shape()), shape_string(dout.shape()));
}

}  // namespace detail

using namespace detail;

int64_t ring_block_length(int64_t length, int ranks, RingLayout layout) {
  if (ranks < 1) raise<ValueError>("mha::dist::ring_block_length", "ranks", ">= 1", std::to_string(ranks));
  const int64_t chunks = int64_t(ranks) * chunks_per_rank(layout);
  return (length + chunks - 1) / chunks * chunks_per_rank(layout);
}

std::vector<int64_t> ring_positions(int64_t length, int rank, int ranks, RingLayout layout) {
  const int64_t c = ring_block_length(length, ranks, layout) / chunks_per_rank(layout);
  std::vector<int64_t> positions;
  for (int64_t chunk : chunks_of(rank, ranks, layout))
    for (int64_t i = 0; i < c; ++i) positions.push_back(chunk * c + i);
  return positions;
}

Tensor ring_shard(const Tensor& full, Communicator& comm, RingLayout layout) {
  const char* fn = "mha::dist::ring_shard";
  check_defined(full, fn, "full");
  if (full.dim() < 2) raise<ShapeError>(fn, "full", "(…, L, X)", shape_string(full.shape()));
  const Ring g = make_ring(comm, full.size(-2), layout);
  Shape shape = full.shape();
  shape[shape.size() - 2] = g.rows;
  Tensor rows = Tensor::zeros(shape, full.dtype());
  for (size_t s = 0; s < g.mine.size(); ++s) {
    const int64_t start = g.mine[s] * g.chunk, real = std::clamp<int64_t>(g.length - start, 0, g.chunk);
    if (real == 0) continue;
    Tensor to = rows.slice(rows.dim() - 2, int64_t(s) * g.chunk, int64_t(s) * g.chunk + real);
    to.copy_(full.slice(full.dim() - 2, start, start + real));
  }
  return rows;
}

Tensor ring_unshard(const Tensor& rows_in, int64_t length, Communicator& comm, RingLayout layout) {
  const char* fn = "mha::dist::ring_unshard";
  check_defined(rows_in, fn, "rows");
  const Ring g = make_ring(comm, length, layout);
  if (rows_in.dim() < 2 || rows_in.size(-2) != g.rows)
    raise<ShapeError>(fn, "rows", "(…, " + std::to_string(g.rows) + ", X)", shape_string(rows_in.shape()));
  const Tensor rows = rows_in.contiguous();
  Shape all_shape = rows.shape();
  all_shape.insert(all_shape.begin(), g.P);
  Tensor all = Tensor::empty(all_shape, rows.dtype());
  comm.all_gather(rows.raw_data(), all.raw_data(), rows.numel(), rows.dtype());
  Shape shape = rows.shape();
  shape[shape.size() - 2] = length;
  Tensor full = Tensor::empty(shape, rows.dtype());
  for (int q = 0; q < g.P; ++q) {
    const Tensor theirs = all.select(0, q);
    const std::vector<int64_t> chunks = chunks_of(q, g.P, layout);
    for (size_t s = 0; s < chunks.size(); ++s) {
      const int64_t start = chunks[s] * g.chunk, real = std::clamp<int64_t>(length - start, 0, g.chunk);
      if (real == 0) continue;
      Tensor to = full.slice(full.dim() - 2, start, start + real);
      to.copy_(theirs.slice(theirs.dim() - 2, int64_t(s) * g.chunk, int64_t(s) * g.chunk + real));
    }
  }
  return full;
}

}  // namespace mha::dist
