// Ring attention: the blocks' merge through their lse, and the ring's
// forward and backward over the fused kernel (ring_attention.h).
#include "mha/dist/ring_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "check.h"
#include "dist/sequence_layout.h"

namespace mha::dist {
namespace {

using namespace detail;

constexpr int kTagKey = 0x7201, kTagValue = 0x7202, kTagKeyGrad = 0x7203, kTagValueGrad = 0x7204;

// Which (query, key) pairs of chunk a against chunk b are visible by causality.
enum class Band { none, full, diagonal };
Band band(int64_t a, int64_t b, Causal causal) {
  if (causal == Causal::none || b < a) return Band::full;
  return b == a ? Band::diagonal : Band::none;
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
    if (g.P > 1) exchange_gradients();  // on behind the block (after the last step: home)
    for (auto& request : exchange) request->wait();
    std::swap(key, next_key), std::swap(value, next_value);
  }
  if (g.P > 1) receive_gradients();
  grads.dkey = dkey, grads.dvalue = dvalue;
  work.bytes_sent = comm.bytes_sent() - sent_before;
  if (o.work) *o.work = work;
  return grads;
}

}  // namespace

AttentionOutput ring_attention_forward(Communicator& comm, const Tensor& query, const Tensor& key,
                                       const Tensor& value, const RingOptions& options) {
  const Tensor mask = check_sequence_parallel("mha::dist::ring_attention_forward", comm, query, key, value, options);
  return query.dtype() == DType::float64 ? forward_ring<double>(comm, query, key, value, options, mask)
                                         : forward_ring<float>(comm, query, key, value, options, mask);
}

AttentionGradients ring_attention_backward(Communicator& comm, const Tensor& dout, const Tensor& query,
                                           const Tensor& key, const Tensor& value, const AttentionOutput& forward,
                                           const RingOptions& options) {
  const char* fn = "mha::dist::ring_attention_backward";
  const Tensor mask = check_sequence_parallel(fn, comm, query, key, value, options);
  check_backward_inputs(fn, dout, forward);
  return query.dtype() == DType::float64
             ? backward_ring<double>(comm, dout, query, key, value, forward, options, mask)
             : backward_ring<float>(comm, dout, query, key, value, forward, options, mask);
}

}  // namespace mha::dist
