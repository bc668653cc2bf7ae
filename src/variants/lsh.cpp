// Reformer LSH attention: random-rotation hashing, a counting sort by bucket,
// chunked attention (own chunk + the one before) with an online softmax across
// rounds, and a backward that recomputes the hashes. The derivation is in
// include/mha/variants/lsh.h.
#include "mha/variants/lsh.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/gemm.h"
#include "mha/random.h"
#include "variants/common.h"

namespace mha {

namespace {

using variants::Buffer;
using variants::dispatch_real;

struct Call {
  int64_t batch = 1, L = 0, E = 0, Ev = 0;
  double scale = 1.0;
  LshOptions o;
  Tensor rotations;  // (hashes, E, buckets/2) float64; undefined with one bucket
};

Call check_call(const Tensor& q, const Tensor& v, const LshOptions& o, const std::string& fn) {
  variants::check_operand(q, fn, "query", "(…, L, E)");
  variants::check_operand(v, fn, "value", "(…, L, Ev)");
  variants::check_same_dtype(v, q, fn, "value", "query");
  variants::check_same_leading(v, q, 1, fn, "value", "query");
  if (o.buckets < 1 || (o.buckets > 1 && o.buckets % 2 != 0))
    raise<ValueError>(fn, "options.buckets", "1 or an even number >= 2", std::to_string(o.buckets));
  variants::check_at_least(o.hashes, 1, fn, "options.hashes");
  variants::check_at_least(o.chunk, 1, fn, "options.chunk");
  Call c;
  c.batch = shape_numel(variants::leading(q.shape(), 2));
  c.L = q.size(-2), c.E = q.size(-1), c.Ev = v.size(-1);
  c.scale = variants::resolve_scale(o.scale, c.E, fn);
  c.o = o;
  if (o.buckets > 1) {
    Generator gen(o.seed);
    c.rotations = randn({o.hashes, c.E, o.buckets / 2}, gen, 0.0, 1.0, DType::float64);
  }
  return c;
}

// Round r's bucket of every row of q (L × E): argmax over [x R, -x R], the
// first maximum on ties. Computed in float64 whatever T is, so that float32
// and float64 inputs hash alike, as products of blocks of rows with R.
template <class T>
void hash_round(const Call& c, int64_t r, const T* q, int64_t* bucket) {
  const int64_t half = c.o.buckets / 2, E = c.E, L = c.L;
  if (c.o.buckets == 1) return std::fill(bucket, bucket + L, int64_t(0));
  const double* R = c.rotations.data<double>() + r * E * half;
  constexpr int64_t kRows = 128;  // rows per product: the projections stay in L2 (128 × buckets/2 doubles)
#pragma omp parallel
  {
    std::vector<double> x(static_cast<size_t>(kRows * E)), proj(static_cast<size_t>(kRows * half));
#pragma omp for schedule(static)
    for (int64_t i0 = 0; i0 < L; i0 += kRows) {
      const int64_t rows = std::min(kRows, L - i0);
      std::copy(q + i0 * E, q + (i0 + rows) * E, x.begin());
      cpu::gemm<double>(false, false, rows, half, E, 1.0, x.data(), E, R, half, 0.0, proj.data(), half);
      for (int64_t a = 0; a < rows; ++a) {
        const double* p = &proj[size_t(a * half)];
        int64_t arg = 0;
        double best = p[0];
        for (int64_t b = 1; b < 2 * half; ++b) {
          const double value = b < half ? p[b] : -p[b - half];
          if (value > best) best = value, arg = b;
        }
        bucket[i0 + a] = arg;
      }
    }
  }
}

// Positions sorted by (bucket, position): a stable counting sort.
void sort_by_bucket(const int64_t* bucket, int64_t L, int64_t buckets, int64_t* order) {
  std::vector<int64_t> start(static_cast<size_t>(buckets + 1), 0);
  for (int64_t i = 0; i < L; ++i) ++start[size_t(bucket[i] + 1)];
  for (int64_t b = 0; b < buckets; ++b) start[size_t(b + 1)] += start[size_t(b)];
  for (int64_t i = 0; i < L; ++i) order[start[size_t(bucket[i])]++] = i;
}

// Chunks of the sorted order: chunk c holds order[c·C, min(L, (c+1)·C)).
struct Chunks {
  int64_t L, C, count;

  Chunks(int64_t length, int64_t chunk) : L(length), C(chunk), count((length + chunk - 1) / chunk) {}
  int64_t begin(int64_t c) const { return c * C; }
  int64_t size(int64_t c) const { return std::min(L, (c + 1) * C) - c * C; }
  int64_t previous(int64_t c) const { return count > 1 ? (c + count - 1) % count : -1; }  // the first looks at the last
};

// One chunk's queries and the keys they see, gathered into contiguous rows,
// and their logits with the self and causal rules applied (-inf).
template <class T>
struct Window {
  int64_t n = 0, m = 0;              // queries; keys (the first n are the queries' own positions)
  std::vector<int64_t> qpos, kpos;
  std::vector<T> q, k, v, s;         // n × E, m × E, m × Ev, n × m

  explicit Window(const Call& c)
      : qpos(static_cast<size_t>(c.o.chunk)), kpos(static_cast<size_t>(2 * c.o.chunk)),
        q(static_cast<size_t>(c.o.chunk * c.E)), k(static_cast<size_t>(2 * c.o.chunk * c.E)),
        v(static_cast<size_t>(2 * c.o.chunk * c.Ev)), s(static_cast<size_t>(2 * c.o.chunk * c.o.chunk)) {}

  void gather(const Call& c, const Chunks& ch, int64_t cc, const int64_t* order, const T* Q, const T* K, const T* V) {
    const int64_t E = c.E, Ev = c.Ev, prev = ch.previous(cc);
    n = ch.size(cc);
    m = 0;
    for (int64_t a = 0; a < n; ++a) qpos[size_t(a)] = kpos[size_t(m++)] = order[ch.begin(cc) + a];
    if (prev >= 0)
      for (int64_t a = 0; a < ch.size(prev); ++a) kpos[size_t(m++)] = order[ch.begin(prev) + a];
    for (int64_t a = 0; a < n; ++a) std::copy(Q + qpos[size_t(a)] * E, Q + (qpos[size_t(a)] + 1) * E, &q[size_t(a * E)]);
    for (int64_t t = 0; t < m; ++t) {
      std::copy(K + kpos[size_t(t)] * E, K + (kpos[size_t(t)] + 1) * E, &k[size_t(t * E)]);
      std::copy(V + kpos[size_t(t)] * Ev, V + (kpos[size_t(t)] + 1) * Ev, &v[size_t(t * Ev)]);
    }
    cpu::gemm<T>(false, true, n, m, E, T(c.scale), q.data(), E, k.data(), E, T(0), s.data(), m);
    for (int64_t a = 0; a < n; ++a)
      for (int64_t t = 0; t < m; ++t)
        if (kpos[size_t(t)] == qpos[size_t(a)] || (c.o.causal && kpos[size_t(t)] > qpos[size_t(a)]))
          s[size_t(a * m + t)] = -INFINITY;
  }
};

// The keys: rows of q normalised (a zero row stays zero), and the norms.
template <class T>
void normalised_keys(const Call& c, const T* q, Buffer<T>& keys, Buffer<T>& norms) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < c.L; ++i) {
    T sq = 0;
    for (int64_t e = 0; e < c.E; ++e) sq += q[i * c.E + e] * q[i * c.E + e];
    const T norm = std::sqrt(sq);
    norms[i] = norm;
    for (int64_t e = 0; e < c.E; ++e) keys[i * c.E + e] = norm > T(0) ? q[i * c.E + e] / norm : T(0);
  }
}

template <class T>
void forward_entry(const Call& c, const T* Q, const T* V, T* out, T* lse) {
  const int64_t L = c.L, E = c.E, Ev = c.Ev;
  Buffer<T> keys(L * E), norms(L);
  normalised_keys(c, Q, keys, norms);
  Buffer<T> run_max(L, T(-INFINITY)), run_sum(L, T(0));
  std::fill(out, out + L * Ev, T(0));  // the accumulators
  Buffer<int64_t> bucket(L), order(L);
  const Chunks ch(L, c.o.chunk);
  for (int64_t r = 0; r < c.o.hashes; ++r) {
    hash_round(c, r, Q, bucket.data());
    sort_by_bucket(bucket.data(), L, c.o.buckets, order.data());
#pragma omp parallel
    {
      Window<T> w(c);
      std::vector<T> pv(static_cast<size_t>(c.o.chunk * Ev));
#pragma omp for schedule(dynamic)
      for (int64_t cc = 0; cc < ch.count; ++cc) {
        w.gather(c, ch, cc, order.data(), Q, keys.data(), V);
        for (int64_t a = 0; a < w.n; ++a) {  // fold this round into the query's running softmax
          T* s = &w.s[size_t(a * w.m)];
          const int64_t i = w.qpos[size_t(a)];
          const T row_max = *std::max_element(s, s + w.m);
          if (row_max == -INFINITY) {  // no other key this round
            std::fill(s, s + w.m, T(0));
            continue;
          }
          const T new_max = std::max(run_max[i], row_max), alpha = std::exp(run_max[i] - new_max);
          T total = 0;
          for (int64_t t = 0; t < w.m; ++t) total += (s[t] = std::exp(s[t] - new_max));
          run_sum[i] = alpha * run_sum[i] + total;
          run_max[i] = new_max;
          for (int64_t e = 0; e < Ev; ++e) out[i * Ev + e] *= alpha;
        }
        cpu::gemm<T>(false, false, w.n, Ev, w.m, T(1), w.s.data(), w.m, w.v.data(), Ev, T(0), pv.data(), Ev);
        for (int64_t a = 0; a < w.n; ++a)
          for (int64_t e = 0; e < Ev; ++e) out[w.qpos[size_t(a)] * Ev + e] += pv[size_t(a * Ev + e)];
      }
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < L; ++i) {
    if (run_sum[i] > T(0)) {
      for (int64_t e = 0; e < Ev; ++e) out[i * Ev + e] /= run_sum[i];
      lse[i] = run_max[i] + std::log(run_sum[i]);
    } else {  // nothing but itself: weight 1 on its own value; s_ii = scale·q_i·q_i/|q_i|
      std::copy(V + i * Ev, V + (i + 1) * Ev, out + i * Ev);
      lse[i] = T(c.scale) * norms[i];
    }
  }
}

template <class T>
void backward_entry(const Call& c, const T* Q, const T* V, const T* out, const T* lse, const T* dout, T* dq, T* dv) {
  const int64_t L = c.L, E = c.E, Ev = c.Ev, C = c.o.chunk;
  const T scale = T(c.scale);
  Buffer<T> keys(L * E), norms(L), dkeys(L * E, T(0)), D(L);
  normalised_keys(c, Q, keys, norms);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < L; ++i) {
    T d = 0;
    for (int64_t e = 0; e < Ev; ++e) d += dout[i * Ev + e] * out[i * Ev + e];
    D[i] = d;
  }
  Buffer<bool> seen(L, false);  // some round gave the query another key
  Buffer<int64_t> bucket(L), order(L);
  const Chunks ch(L, C);
  // Gradients of each chunk's look-back keys, added to the previous chunk's rows afterwards.
  Buffer<T> back_k(ch.count * C * E), back_v(ch.count * C * Ev);
  for (int64_t r = 0; r < c.o.hashes; ++r) {
    hash_round(c, r, Q, bucket.data());
    sort_by_bucket(bucket.data(), L, c.o.buckets, order.data());
#pragma omp parallel
    {
      Window<T> w(c);
      std::vector<T> dov(static_cast<size_t>(C * Ev)), ds(static_cast<size_t>(2 * C * C)),
          dqw(static_cast<size_t>(C * E)), dkw(static_cast<size_t>(2 * C * E)), dvw(static_cast<size_t>(2 * C * Ev));
#pragma omp for schedule(dynamic)
      for (int64_t cc = 0; cc < ch.count; ++cc) {
        w.gather(c, ch, cc, order.data(), Q, keys.data(), V);
        const int64_t n = w.n, m = w.m;
        for (int64_t a = 0; a < n; ++a) {  // P = exp(s - lse) over the allowed keys
          const int64_t i = w.qpos[size_t(a)];
          std::copy(dout + i * Ev, dout + (i + 1) * Ev, &dov[size_t(a * Ev)]);
          for (int64_t t = 0; t < m; ++t) {
            T& x = w.s[size_t(a * m + t)];
            if (x != -INFINITY) seen[i] = true;
            x = x == -INFINITY ? T(0) : std::exp(x - lse[i]);
          }
        }
        cpu::gemm<T>(false, true, n, m, Ev, T(1), dov.data(), Ev, w.v.data(), Ev, T(0), ds.data(), m);  // dout·v_j
        for (int64_t a = 0; a < n; ++a)
          for (int64_t t = 0; t < m; ++t)
            ds[size_t(a * m + t)] = w.s[size_t(a * m + t)] * (ds[size_t(a * m + t)] - D[w.qpos[size_t(a)]]);
        cpu::gemm<T>(false, false, n, E, m, scale, ds.data(), m, w.k.data(), E, T(0), dqw.data(), E);
        cpu::gemm<T>(true, false, m, E, n, scale, ds.data(), m, w.q.data(), E, T(0), dkw.data(), E);
        cpu::gemm<T>(true, false, m, Ev, n, T(1), w.s.data(), m, dov.data(), Ev, T(0), dvw.data(), Ev);
        for (int64_t a = 0; a < n; ++a) {  // the chunk's own rows: queries and keys
          const int64_t i = w.qpos[size_t(a)];
          for (int64_t e = 0; e < E; ++e) dq[i * E + e] += dqw[size_t(a * E + e)], dkeys[i * E + e] += dkw[size_t(a * E + e)];
          for (int64_t e = 0; e < Ev; ++e) dv[i * Ev + e] += dvw[size_t(a * Ev + e)];
        }
        std::copy(dkw.begin() + n * E, dkw.begin() + m * E, back_k.data() + cc * C * E);
        std::copy(dvw.begin() + n * Ev, dvw.begin() + m * Ev, back_v.data() + cc * C * Ev);
      }
#pragma omp for schedule(static)
      for (int64_t cc = 0; cc < ch.count; ++cc) {  // c → previous(c) is one to one: no two write a row
        const int64_t prev = ch.previous(cc);
        if (prev < 0) continue;
        for (int64_t a = 0; a < ch.size(prev); ++a) {
          const int64_t j = order[ch.begin(prev) + a];
          for (int64_t e = 0; e < E; ++e) dkeys[j * E + e] += back_k[(cc * C + a) * E + e];
          for (int64_t e = 0; e < Ev; ++e) dv[j * Ev + e] += back_v[(cc * C + a) * Ev + e];
        }
      }
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < L; ++i) {
    if (!seen[i])  // out_i = v_i
      for (int64_t e = 0; e < Ev; ++e) dv[i * Ev + e] += dout[i * Ev + e];
    const T norm = norms[i];
    if (norm == T(0)) continue;
    const T* k = keys.data() + i * E;
    const T* dk = dkeys.data() + i * E;
    T dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += k[e] * dk[e];
    for (int64_t e = 0; e < E; ++e) dq[i * E + e] += (dk[e] - k[e] * dot) / norm;
  }
}

}  // namespace

LshOutput lsh_attention_forward(const Tensor& query, const Tensor& value, const LshOptions& options) {
  const std::string fn = "mha::lsh_attention_forward";
  const Call c = check_call(query, value, options, fn);
  const Shape lead = variants::leading(query.shape(), 2);
  LshOutput r{Tensor::empty(variants::with_tail(lead, {c.L, c.Ev}), query.dtype()),
              Tensor::empty(variants::with_tail(lead, {c.L}), query.dtype())};
  dispatch_real(query.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const Tensor q = query.contiguous(), v = value.contiguous();
    for (int64_t b = 0; b < c.batch; ++b)
      forward_entry<T>(c, q.data<T>() + b * c.L * c.E, v.data<T>() + b * c.L * c.Ev, r.out.data<T>() + b * c.L * c.Ev,
                       r.lse.data<T>() + b * c.L);
  });
  return r;
}

LshGradients lsh_attention_backward(const Tensor& dout, const Tensor& query, const Tensor& value,
                                    const LshOutput& forward, const LshOptions& options) {
  const std::string fn = "mha::lsh_attention_backward";
  const Call c = check_call(query, value, options, fn);
  const Shape lead = variants::leading(query.shape(), 2);
  variants::check_saved(dout, variants::with_tail(lead, {c.L, c.Ev}), {{&forward.out, "forward.out"}},
                        variants::with_tail(lead, {c.L}), {{&forward.lse, "forward.lse"}}, query.dtype(), fn);
  LshGradients g{Tensor::zeros(query.shape(), query.dtype()), Tensor::zeros(value.shape(), query.dtype())};
  dispatch_real(query.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const Tensor q = query.contiguous(), v = value.contiguous(), d = dout.contiguous(), o = forward.out.contiguous(),
                 lse = forward.lse.contiguous();
    for (int64_t b = 0; b < c.batch; ++b)
      backward_entry<T>(c, q.data<T>() + b * c.L * c.E, v.data<T>() + b * c.L * c.Ev, o.data<T>() + b * c.L * c.Ev,
                        lse.data<T>() + b * c.L, d.data<T>() + b * c.L * c.Ev, g.dquery.data<T>() + b * c.L * c.E,
                        g.dvalue.data<T>() + b * c.L * c.Ev);
  });
  return g;
}

Tensor lsh_buckets(const Tensor& query, const LshOptions& options) {
  const std::string fn = "mha::lsh_buckets";
  const Call c = check_call(query, query, options, fn);
  Shape shape = variants::leading(query.shape(), 1);
  shape.insert(shape.begin(), options.hashes);
  Tensor buckets = Tensor::empty(shape, DType::int64);
  dispatch_real(query.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const Tensor q = query.contiguous();
    for (int64_t r = 0; r < options.hashes; ++r)
      for (int64_t b = 0; b < c.batch; ++b)
        hash_round(c, r, q.data<T>() + b * c.L * c.E, buckets.data<int64_t>() + (r * c.batch + b) * c.L);
  });
  return buckets;
}

}  // namespace mha
