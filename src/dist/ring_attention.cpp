// Ring attention: the layouts, the blocks' merge through their lse, and the
// ring's forward and backward over the fused kernel (ring_attention.h).
#include "mha/dist/ring_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "check.h"

namespace mha::dist {
namespace {

constexpr int kTagKey = 0x7201, kTagValue = 0x7202, kTagKeyGrad = 0x7203, kTagValueGrad = 0x7204;

int chunks_per_rank(RingLayout layout) { return layout == RingLayout::zigzag ? 2 : 1; }

// The chunks rank q holds, in the order of its rows.
std::vector<int64_t> chunks_of(int q, int P, RingLayout layout) {
  if (layout == RingLayout::contiguous) return {q};
  return {q, 2 * int64_t(P) - 1 - q};
}

// Which (query, key) pairs of chunk a against chunk b are visible by causality.
enum class Band { none, full, diagonal };
Band band(int64_t a, int64_t b, Causal causal) {
  if (causal == Causal::none || b < a) return Band::full;
  return b == a ? Band::diagonal : Band::none;
}

struct Ring {
  int P = 1, r = 0;
  RingLayout layout = RingLayout::zigzag;
  int64_t length = 0, chunk = 0, rows = 0;  // chunk: positions a chunk; rows: a rank's
  std::vector<int64_t> mine;                 // this rank's chunks
};

Ring make_ring(const Communicator& comm, int64_t length, RingLayout layout) {
  Ring g;
  g.P = comm.size(), g.r = comm.rank(), g.layout = layout, g.length = length;
  g.rows = ring_block_length(length, g.P, layout);
  g.chunk = g.rows / chunks_per_rank(layout);
  g.mine = chunks_of(g.r, g.P, layout);
  return g;
}

// The mask of queries of chunk a against keys of chunk b: the user's mask's
// block (its leading dims kept) and the padding (masked both ways);
// undefined where neither applies. `user` is the user's mask, contiguous,
// at least 2-D, bool or float64.
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

// rows of t (…, Lr, X) in slot s (a chunk of c rows).
Tensor slot(const Tensor& t, int64_t s, int64_t c) { return t.slice(t.dim() - 2, s * c, (s + 1) * c); }

// acc's rows of slot s (acc contiguous (…, Lr, X)) += part (…, c, X).
template <class T>
void add_rows(Tensor& acc, const Tensor& part_in, int64_t s, int64_t c) {
  const Tensor part = part_in.contiguous();
  const int64_t X = acc.size(-1), Lr = acc.size(-2), n = acc.numel() / (Lr * X);
  T* a = acc.data<T>();
  const T* p = part.data<T>();
  for (int64_t m = 0; m < n; ++m)
    for (int64_t i = 0; i < c * X; ++i) a[(m * Lr + s * c) * X + i] += p[m * c * X + i];
}

// Merges a block's (out, lse) into the running (out, lse) of slot s.
template <class T>
void merge(Tensor& out, Tensor& lse, const AttentionOutput& part, int64_t s, int64_t c) {
  const int64_t Ev = out.size(-1), Lr = out.size(-2), n = out.numel() / (Lr * Ev);
  T* o = out.data<T>();
  T* l = lse.data<T>();
  const Tensor po = part.out.contiguous(), pl = part.lse.contiguous();
  const T* bo = po.data<T>();
  const T* bl = pl.data<T>();
  for (int64_t m = 0; m < n; ++m)
    for (int64_t i = 0; i < c; ++i) {
      const int64_t row = m * Lr + s * c + i;
      const T la = l[row], lb = bl[m * c + i];
      if (lb == -std::numeric_limits<T>::infinity()) continue;  // the block showed this row nothing
      const T top = std::max(la, lb);
      const T merged = top + std::log(std::exp(la - top) + std::exp(lb - top));
      const T wa = std::exp(la - merged), wb = std::exp(lb - merged);
      T* y = o + row * Ev;
      const T* z = bo + (m * c + i) * Ev;
      for (int64_t e = 0; e < Ev; ++e) y[e] = wa * y[e] + wb * z[e];
      l[row] = merged;
    }
}

// The checks every ring call makes; the user's mask prepared for block_mask.
Tensor check_ring(const char* fn, const Communicator& comm, const Tensor& q, const Tensor& k, const Tensor& v,
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

AttentionOptions block_options(const RingOptions& o, const Tensor& mask, Band b) {
  AttentionOptions a;
  a.mask = mask;
  a.causal = b == Band::diagonal ? Causal::top_left : Causal::none;
  a.scale = o.scale;
  return a;
}

int64_t visible_pairs(Band b, int64_t c) { return b == Band::full ? c * c : b == Band::diagonal ? c * (c + 1) / 2 : 0; }

template <class T>
AttentionOutput forward_ring(Communicator& comm, const Tensor& q, const Tensor& k, const Tensor& v,
                             const RingOptions& o, const Tensor& user_mask) {
  const Ring g = make_ring(comm, o.length, o.layout);
  const int64_t sent_before = comm.bytes_sent();
  Shape lse_shape(q.shape().begin(), q.shape().end() - 1);
  Shape out_shape = lse_shape;
  out_shape.push_back(v.size(-1));
  AttentionOutput result;
  result.out = Tensor::zeros(out_shape, q.dtype());
  result.lse = Tensor::full(lse_shape, -INFINITY, q.dtype());
  Tensor key = k.contiguous().clone(), value = v.contiguous().clone();
  Tensor next_key = Tensor::empty(key.shape(), key.dtype()), next_value = Tensor::empty(value.shape(), value.dtype());
  RingWork work;
  for (int t = 0; t < g.P; ++t) {
    std::vector<std::unique_ptr<Request>> exchange;
    if (t + 1 < g.P) {  // the next block travels while this one is computed
      const int to = (g.r + 1) % g.P, from = (g.r + g.P - 1) % g.P;
      exchange.push_back(comm.send_receive_start(key.raw_data(), key.numel(), to, next_key.raw_data(), key.numel(),
                                                 from, key.dtype(), kTagKey));
      exchange.push_back(comm.send_receive_start(value.raw_data(), value.numel(), to, next_value.raw_data(),
                                                 value.numel(), from, value.dtype(), kTagValue));
    }
    const std::vector<int64_t> theirs = chunks_of((g.r - t + g.P) % g.P, g.P, g.layout);
    for (size_t a = 0; a < g.mine.size(); ++a)
      for (size_t b = 0; b < theirs.size(); ++b) {
        const Band visible = band(g.mine[a], theirs[b], o.causal);
        if (visible == Band::none) continue;
        const AttentionOutput part =
            attention_forward(slot(q, int64_t(a), g.chunk), slot(key, int64_t(b), g.chunk),
                              slot(value, int64_t(b), g.chunk),
                              block_options(o, block_mask(user_mask, g, g.mine[a], theirs[b]), visible));
        merge<T>(result.out, result.lse, part, int64_t(a), g.chunk);
        result.path = part.path;
        work.pairs += visible_pairs(visible, g.chunk), ++work.blocks;
      }
    for (auto& request : exchange) request->wait();
    std::swap(key, next_key), std::swap(value, next_value);
  }
  work.bytes_sent = comm.bytes_sent() - sent_before;
  if (o.work) *o.work = work;
  return result;
}

template <class T>
AttentionGradients backward_ring(Communicator& comm, const Tensor& dout, const Tensor& q, const Tensor& k,
                                 const Tensor& v, const AttentionOutput& forward, const RingOptions& o,
                                 const Tensor& user_mask) {
  const Ring g = make_ring(comm, o.length, o.layout);
  const int64_t sent_before = comm.bytes_sent();
  const int to = (g.r + 1) % g.P, from = (g.r + g.P - 1) % g.P;
  AttentionGradients grads;
  grads.dquery = Tensor::zeros(q.shape(), q.dtype());
  Tensor key = k.contiguous().clone(), value = v.contiguous().clone();
  Tensor next_key = Tensor::empty(key.shape(), key.dtype()), next_value = Tensor::empty(value.shape(), value.dtype());
  // The gradients of the block in hand, and the buffers the next one arrives in.
  Tensor dkey = Tensor::zeros(k.shape(), k.dtype()), dvalue = Tensor::zeros(v.shape(), v.dtype());
  Tensor next_dkey = Tensor::empty(k.shape(), k.dtype()), next_dvalue = Tensor::empty(v.shape(), v.dtype());
  std::vector<std::unique_ptr<Request>> gradients_in_flight;
  const auto exchange_gradients = [&] {
    gradients_in_flight.push_back(comm.send_receive_start(dkey.raw_data(), dkey.numel(), to, next_dkey.raw_data(),
                                                          dkey.numel(), from, dkey.dtype(), kTagKeyGrad));
    gradients_in_flight.push_back(comm.send_receive_start(dvalue.raw_data(), dvalue.numel(), to,
                                                          next_dvalue.raw_data(), dvalue.numel(), from,
                                                          dvalue.dtype(), kTagValueGrad));
  };
  const auto receive_gradients = [&] {
    for (auto& request : gradients_in_flight) request->wait();
    gradients_in_flight.clear();
    std::swap(dkey, next_dkey), std::swap(dvalue, next_dvalue);
  };
  RingWork work;
  for (int t = 0; t < g.P; ++t) {
    std::vector<std::unique_ptr<Request>> exchange;
    if (t + 1 < g.P) {
      exchange.push_back(comm.send_receive_start(key.raw_data(), key.numel(), to, next_key.raw_data(), key.numel(),
                                                 from, key.dtype(), kTagKey));
      exchange.push_back(comm.send_receive_start(value.raw_data(), value.numel(), to, next_value.raw_data(),
                                                 value.numel(), from, value.dtype(), kTagValue));
    }
    // This block's shares, computed while its gradients so far arrive.
    const std::vector<int64_t> theirs = chunks_of((g.r - t + g.P) % g.P, g.P, g.layout);
    std::vector<std::pair<int64_t, AttentionGradients>> shares;
    for (size_t a = 0; a < g.mine.size(); ++a)
      for (size_t b = 0; b < theirs.size(); ++b) {
        const Band visible = band(g.mine[a], theirs[b], o.causal);
        if (visible == Band::none) continue;
        AttentionOutput rows;
        rows.out = slot(forward.out, int64_t(a), g.chunk);
        rows.lse = forward.lse.slice(forward.lse.dim() - 1, int64_t(a) * g.chunk, int64_t(a + 1) * g.chunk);
        rows.path = forward.path;
        AttentionGradients share = attention_backward(
            slot(dout, int64_t(a), g.chunk), slot(q, int64_t(a), g.chunk), slot(key, int64_t(b), g.chunk),
            slot(value, int64_t(b), g.chunk), rows,
            block_options(o, block_mask(user_mask, g, g.mine[a], theirs[b]), visible));
        add_rows<T>(grads.dquery, share.dquery, int64_t(a), g.chunk);
        shares.emplace_back(int64_t(b), std::move(share));
        work.pairs += visible_pairs(visible, g.chunk), ++work.blocks;
      }
    if (t > 0) receive_gradients();
    for (auto& [b, share] : shares) {
      add_rows<T>(dkey, share.dkey, b, g.chunk);
      add_rows<T>(dvalue, share.dvalue, b, g.chunk);
    }
    exchange_gradients();  // on behind the block (after the last step: home)
    for (auto& request : exchange) request->wait();
    std::swap(key, next_key), std::swap(value, next_value);
  }
  receive_gradients();
  grads.dkey = dkey, grads.dvalue = dvalue;
  work.bytes_sent = comm.bytes_sent() - sent_before;
  if (o.work) *o.work = work;
  return grads;
}

}  // namespace

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

AttentionOutput ring_attention_forward(Communicator& comm, const Tensor& query, const Tensor& key,
                                       const Tensor& value, const RingOptions& options) {
  const Tensor mask = check_ring("mha::dist::ring_attention_forward", comm, query, key, value, options);
  return query.dtype() == DType::float64 ? forward_ring<double>(comm, query, key, value, options, mask)
                                         : forward_ring<float>(comm, query, key, value, options, mask);
}

AttentionGradients ring_attention_backward(Communicator& comm, const Tensor& dout, const Tensor& query,
                                           const Tensor& key, const Tensor& value, const AttentionOutput& forward,
                                           const RingOptions& options) {
  const char* fn = "mha::dist::ring_attention_backward";
  const Tensor mask = check_ring(fn, comm, query, key, value, options);
  check_defined(dout, fn, "dout");
  check_defined(forward.out, fn, "forward.out");
  if (dout.shape() != forward.out.shape())
    raise<ShapeError>(fn, "dout", "forward.out's shape " + shape_string(forward.out.shape()), shape_string(dout.shape()));
  return query.dtype() == DType::float64
             ? backward_ring<double>(comm, dout, query, key, value, forward, options, mask)
             : backward_ring<float>(comm, dout, query, key, value, forward, options, mask);
}

}  // namespace mha::dist
