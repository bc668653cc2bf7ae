// Reformer LSH attention: random-rotation hashing, a counting sort by bucket,
// chunked attention (own chunk + the one before) with an online softmax across
// rounds, and a backward that recomputes the hashes. The derivation is in
// include/mha/variants/lsh.h.
#include "mha/variants/lsh.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu/gemm.h"
#include "cpu/parallel.h"
#include "finite.h"
#define MHA_ISA_NAMESPACE variants_portable
#include "cpu/simd/vec.h"
#include "mha/random.h"
#include "variants/common.h"

namespace mha {

namespace {

using variants::Buffer;
using variants::dispatch_real;
using variants::dot;

struct Call {
  int64_t batch = 1, L = 0, E = 0, Ev = 0;
  double scale = 1.0;
  LshOptions o;
  Tensor rotations;    // (hashes, E, buckets/2) float64; undefined with one bucket
  Tensor rotations32;  // the same rounded to float32
  std::vector<double> column_norm;  // per round r: max over b of |R_r[:, b]|
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
    const int64_t half = o.buckets / 2;
    c.rotations = randn({o.hashes, c.E, half}, gen, 0.0, 1.0, DType::float64);
    c.rotations32 = c.rotations.to(DType::float32);
    const double* R = c.rotations.data<double>();
    for (int64_t r = 0; r < o.hashes; ++r) {
      double most = 0;
      for (int64_t b = 0; b < half; ++b) {
        double sq = 0;
        for (int64_t e = 0; e < c.E; ++e) sq += R[(r * c.E + e) * half + b] * R[(r * c.E + e) * half + b];
        most = std::max(most, sq);
      }
      c.column_norm.push_back(std::sqrt(most));
    }
  }
  return c;
}

// The hash of one row x: the first b in [0, 2h) maximising [p, -p]_b, where
// p = x R (h = buckets/2) in float64, summed over e in order. p32, the same
// products from float32 operands and sums, errs from p by at most
//   eps = 2 (E + 2) u |x| max_b |R_b| + E FLT_MIN (1 + max_b |R_b|),  u = 2^-24:
// rounding x and R and each of the E - 1 sums and E products costs at most u of
// Σ_e |x_e R_eb| <= |x| |R_b| (Cauchy-Schwarz), the second term bounds what
// underflow loses, and the factor 2 covers the float64 rounding of p. So no
// b whose float32 value lies below best32 - 2 eps can be the float64 argmax:
// when one value alone reaches that threshold it is the hash, and otherwise
// (a near tie, a zero row, overflow, NaN: the test !(value < t) keeps NaNs)
// the float64 products of the values that reach it decide.
template <class T>
int64_t row_hash(const T* x, const float* p32, const double* R, int64_t E, int64_t half, double column_norm) {
  float hi = -INFINITY, lo = INFINITY;
#pragma omp simd reduction(max : hi) reduction(min : lo)
  for (int64_t b = 0; b < half; ++b) {
    const float value = p32[b];  // written as selects, which vectorise; std::max does not
    hi = value > hi ? value : hi;
    lo = value < lo ? value : lo;
  }
  double sq = 0;
  for (int64_t e = 0; e < E; ++e) sq += double(x[e]) * double(x[e]);
  const double u = std::ldexp(1.0, -24), best = std::max(double(hi), -double(lo));
  const double eps = 2 * double(E + 2) * u * std::sqrt(sq) * column_norm + double(E) * FLT_MIN * (1 + column_norm);
  const double t = std::isfinite(best) ? best - 2 * eps : NAN;
  float tf = float(t);  // rounded down, so that the float comparisons keep every value >= t
  if (double(tf) > t) tf = std::nextafter(tf, -INFINITY);
  int reach = 0;
#pragma omp simd reduction(+ : reach)
  for (int64_t b = 0; b < half; ++b) reach += int(!(p32[b] < tf)) + int(!(-p32[b] < tf));
  if (reach == 1) return hi >= -lo ? std::find(p32, p32 + half, hi) - p32 : half + (std::find(p32, p32 + half, lo) - p32);
  int64_t arg = -1;
  double top = 0;
  for (int64_t b = 0; b < 2 * half; ++b) {
    const int64_t col = b % half;
    const double sign = b < half ? 1.0 : -1.0;
    if (float(sign) * p32[col] < tf) continue;
    double dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += double(x[e]) * R[e * half + col];
    if (arg < 0 || sign * dot > top) top = sign * dot, arg = b;
  }
  return arg;
}

// Round r's bucket of every row of q (L × E), row_hash's rule: float32
// products of blocks of rows with R (twice float64's rate), the float64 ones
// only near ties. Float32 and float64 inputs of the same values hash alike.
template <class T>
void hash_round(const Call& c, int64_t r, const T* q, int64_t* bucket) {
  const int64_t half = c.o.buckets / 2, E = c.E, L = c.L;
  if (c.o.buckets == 1) return std::fill(bucket, bucket + L, int64_t(0));
  const double* R = c.rotations.data<double>() + r * E * half;
  const float* R32 = c.rotations32.data<float>() + r * E * half;
  constexpr int64_t kRows = 128;  // rows per product: the projections stay in L2 (128 × buckets/2 floats)
  cpu::RegionErrors errors;  // buffers and products may be refused (cpu/parallel.h)
#pragma omp parallel
  {
    std::vector<float> x, proj;
    errors.run([&] { x.resize(std::is_same_v<T, float> ? 0 : size_t(kRows * E)), proj.resize(size_t(kRows * half)); });
#pragma omp for schedule(static)
    for (int64_t i0 = 0; i0 < L; i0 += kRows) errors.run([&] {
      const int64_t rows = std::min(kRows, L - i0);
      const float* xs = nullptr;
      if constexpr (std::is_same_v<T, float>) xs = q + i0 * E;
      else xs = x.data(), std::copy(q + i0 * E, q + (i0 + rows) * E, x.begin());
      cpu::gemm<float>(false, false, rows, half, E, 1.0f, xs, E, R32, half, 0.0f, proj.data(), half);
      for (int64_t a = 0; a < rows; ++a)
        bucket[i0 + a] = row_hash(q + (i0 + a) * E, &proj[size_t(a * half)], R, E, half, c.column_norm[size_t(r)]);
    });
  }
  errors.rethrow();
}

// Positions sorted by (bucket, position): a stable counting sort.
void sort_by_bucket(const int64_t* bucket, int64_t L, int64_t buckets, int64_t* order) {
  std::vector<int64_t> start(static_cast<size_t>(buckets + 1), 0);
  for (int64_t i = 0; i < L; ++i) ++start[size_t(bucket[i] + 1)];
  for (int64_t b = 0; b < buckets; ++b) start[size_t(b + 1)] += start[size_t(b)];
  for (int64_t i = 0; i < L; ++i) order[start[size_t(bucket[i])]++] = i;
}

// x_t = e^(x_t - shift) for t < n, in place; returns their sum. Float rows
// take vec.h's portable 2^x (relative error < 1.2e-7; 0 for -inf), a loop of
// which vectorises (this file is built with -fno-trapping-math for it) where
// one expf call per element does not; float64 keeps std::exp.
template <class T>
T exp_row(T* x, int64_t n, T shift) {
  T total = 0;
  if constexpr (std::is_same_v<T, float>) {
    constexpr float log2e = 1.44269504088896341f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < n; ++t) total += (x[t] = cpu::variants_portable::Vec::exp2_scalar((x[t] - shift) * log2e));
  } else {
    for (int64_t t = 0; t < n; ++t) total += (x[t] = std::exp(x[t] - shift));
  }
  return total;
}

// Chunks of the sorted order: chunk c holds order[c·C, min(L, (c+1)·C)).
struct Chunks {
  int64_t L, C, count;

  Chunks(int64_t length, int64_t chunk) : L(length), C(chunk), count((length + chunk - 1) / chunk) {}
  int64_t begin(int64_t c) const { return c * C; }
  int64_t size(int64_t c) const { return std::min(L, (c + 1) * C) - c * C; }
  int64_t previous(int64_t c) const { return count > 1 ? (c + count - 1) % count : -1; }  // the first looks at the last
};

// Chunks per sweep: a thread takes kSweep consecutive chunks at a time, so a
// chunk's look-back rows are those it gathered for the chunk before (all but
// the first of each sweep). Fixed, not per thread, so that where sweeps start,
// and with it the order of every sum, does not depend on the thread count.
constexpr int64_t kSweep = 16;

// k = q / |q| (a zero row stays zero): the keys.
template <class T>
void normalise(const T* q, T norm, int64_t E, T* k) {
  for (int64_t e = 0; e < E; ++e) k[e] = norm == T(0) ? T(0) : q[e] / norm;  // a NaN norm gives NaN keys
}

// A thread's window on the sorted order as it sweeps chunks c, c+1, …: the
// keys and values of two consecutive chunks in two slots that meet at row C
// (slot 0 holds rows [C - rows, C), slot 1 rows [C, C + rows)), chunk c's own
// in slot c % 2 and its previous chunk's in the other. Both together are then
// one block of contiguous rows, the m keys chunk c's queries see, and moving to
// c + 1 gathers only c + 1's rows into the slot c - 1 held. enter() also gives
// the queries' logits, the self and causal rules applied (-inf).
template <class T>
struct Window {
  const Call& c;
  const Chunks& ch;
  const int64_t* order;
  const T *Q, *norms, *V;
  std::vector<int64_t> pos;  // 2C: the position of each slot row
  std::vector<T> k, v;       // 2C × E keys, 2C × Ev values, by slot row
  std::vector<T> q, s;       // the own chunk's n × E queries; n × m logits
  int64_t rows[2] = {0, 0};  // rows in each slot
  int64_t own = 0, lo = 0, n = 0, m = 0;  // own slot; first key row; queries; keys

  Window(const Call& call, const Chunks& chunks, const int64_t* order_, const T* Q_, const T* norms_, const T* V_)
      : c(call), ch(chunks), order(order_), Q(Q_), norms(norms_), V(V_), pos(static_cast<size_t>(2 * ch.C)),
        k(static_cast<size_t>(2 * ch.C * c.E)), v(static_cast<size_t>(2 * ch.C * c.Ev)),
        q(static_cast<size_t>(ch.C * c.E)), s(static_cast<size_t>(2 * ch.C * ch.C)) {}

  int64_t first(int64_t slot) const { return slot == 0 ? ch.C - rows[0] : ch.C; }
  int64_t other() const { return 1 - own; }
  const int64_t* qpos() const { return &pos[size_t(first(own))]; }
  const T* keys() const { return &k[size_t(lo * c.E)]; }
  const T* values() const { return &v[size_t(lo * c.Ev)]; }

  void load(int64_t slot, int64_t chunk) {
    rows[slot] = ch.size(chunk);
    const int64_t E = c.E, Ev = c.Ev, at = first(slot);
    for (int64_t a = 0; a < rows[slot]; ++a) {
      const int64_t j = order[ch.begin(chunk) + a], t = at + a;
      pos[size_t(t)] = j;
      normalise(Q + j * E, norms[j], E, &k[size_t(t * E)]);
      std::copy(V + j * Ev, V + (j + 1) * Ev, &v[size_t(t * Ev)]);
    }
  }

  // Chunk cc; fresh: the first of a sweep, whose look-back rows are not loaded yet.
  void enter(int64_t cc, bool fresh) {
    const int64_t E = c.E, prev = ch.previous(cc);
    own = cc % 2;
    load(own, cc);
    if (prev < 0) rows[other()] = 0;
    else if (fresh) load(other(), prev);
    n = rows[own], m = rows[0] + rows[1], lo = first(0);
    const int64_t* qp = qpos();
    for (int64_t a = 0; a < n; ++a) std::copy(Q + qp[a] * E, Q + (qp[a] + 1) * E, &q[size_t(a * E)]);
    cpu::gemm<T>(false, true, n, m, E, T(c.scale), q.data(), E, keys(), E, T(0), s.data(), m);
    const int64_t self = first(own) - lo;  // query a's own key is column self + a
    for (int64_t a = 0; a < n; ++a) s[size_t(a * m + self + a)] = -INFINITY;
    if (c.o.causal)
      for (int64_t a = 0; a < n; ++a)
        for (int64_t t = 0; t < m; ++t)
          if (pos[size_t(lo + t)] > qp[a]) s[size_t(a * m + t)] = -INFINITY;
  }
};

// Enters every chunk and runs f(window, scratch, cc, fresh) on it: sweeps of
// kSweep chunks shared among the threads, each with its own Window and Scratch.
template <class T, class Scratch, class F>
void sweep_chunks(const Call& c, const Chunks& ch, const int64_t* order, const T* Q, const T* norms, const T* V, F&& f) {
  cpu::RegionErrors errors;  // windows, scratch and products may be refused (cpu/parallel.h)
#pragma omp parallel
  {
    std::optional<Window<T>> w;
    std::optional<Scratch> scratch;
    errors.run([&] { w.emplace(c, ch, order, Q, norms, V), scratch.emplace(c); });
#pragma omp for schedule(dynamic)
    for (int64_t g = 0; g < (ch.count + kSweep - 1) / kSweep; ++g) errors.run([&] {
      for (int64_t cc = g * kSweep; cc < std::min(ch.count, (g + 1) * kSweep); ++cc) {
        w->enter(cc, cc == g * kSweep);
        f(*w, *scratch, cc, cc == g * kSweep);
      }
    });
  }
  errors.rethrow();
}

// The norms of the rows of q (the keys are the rows over their norms).
template <class T>
void row_norms(const Call& c, const T* q, Buffer<T>& norms) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < c.L; ++i) {
    T sq = 0;
    for (int64_t e = 0; e < c.E; ++e) sq += q[i * c.E + e] * q[i * c.E + e];
    norms[i] = std::sqrt(sq);
  }
}

template <class T>
struct ForwardScratch {
  std::vector<T> pv;  // C × Ev: P·V of a chunk
  explicit ForwardScratch(const Call& c) : pv(static_cast<size_t>(c.o.chunk * c.Ev)) {}
};

template <class T>
void forward_entry(const Call& c, const T* Q, const T* V, T* out, T* lse) {
  const int64_t L = c.L, Ev = c.Ev;
  Buffer<T> norms(L);
  row_norms(c, Q, norms);
  Buffer<T> run_max(L, T(-INFINITY)), run_sum(L, T(0));
  std::fill(out, out + L * Ev, T(0));  // the accumulators
  Buffer<int64_t> bucket(L), order(L);
  const Chunks ch(L, c.o.chunk);
  for (int64_t r = 0; r < c.o.hashes; ++r) {
    hash_round(c, r, Q, bucket.data());
    sort_by_bucket(bucket.data(), L, c.o.buckets, order.data());
    sweep_chunks<T, ForwardScratch<T>>(c, ch, order.data(), Q, norms.data(), V, [&](Window<T>& w, ForwardScratch<T>& x,
                                                                                      int64_t, bool) {
      for (int64_t a = 0; a < w.n; ++a) {  // fold this round into the query's running softmax
        T* s = &w.s[size_t(a * w.m)];
        const int64_t i = w.qpos()[a];
        T row_max = -INFINITY;
        for (int64_t t = 0; t < w.m; ++t) row_max = s[t] > row_max || s[t] != s[t] ? s[t] : row_max;  // NaN stays
        if (row_max == -INFINITY) {  // no other key this round
          std::fill(s, s + w.m, T(0));
          continue;
        }
        const T new_max = std::max(run_max[i], row_max), alpha = std::exp(run_max[i] - new_max);
        run_sum[i] = alpha * run_sum[i] + exp_row(s, w.m, new_max);
        run_max[i] = new_max;
        for (int64_t e = 0; e < Ev; ++e) out[i * Ev + e] *= alpha;
      }
      cpu::gemm<T>(false, false, w.n, Ev, w.m, T(1), w.s.data(), w.m, w.values(), Ev, T(0), x.pv.data(), Ev);
      for (int64_t a = 0; a < w.n; ++a)
        for (int64_t e = 0; e < Ev; ++e) out[w.qpos()[a] * Ev + e] += x.pv[size_t(a * Ev + e)];
    });
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < L; ++i) {
    if (run_sum[i] != T(0)) {  // a NaN sum included
      for (int64_t e = 0; e < Ev; ++e) out[i * Ev + e] /= run_sum[i];
      lse[i] = run_max[i] + std::log(run_sum[i]);
    } else {  // nothing but itself: weight 1 on its own value; s_ii = scale·q_i·q_i/|q_i|
      std::copy(V + i * Ev, V + (i + 1) * Ev, out + i * Ev);
      lse[i] = T(c.scale) * norms[i];
    }
  }
}

template <class T>
struct BackwardScratch {
  std::vector<T> dov, ds, dqw;  // the queries' C × Ev dout, C × 2C dS, C × E dq
  std::vector<T> dk, dvs;       // by slot row, as Window's keys and values: 2C × E, 2C × Ev
  explicit BackwardScratch(const Call& c)
      : dov(static_cast<size_t>(c.o.chunk * c.Ev)), ds(static_cast<size_t>(2 * c.o.chunk * c.o.chunk)),
        dqw(static_cast<size_t>(c.o.chunk * c.E)), dk(static_cast<size_t>(2 * c.o.chunk * c.E)),
        dvs(static_cast<size_t>(2 * c.o.chunk * c.Ev)) {}
};

// Backward per chunk, with the keys' and values' gradients kept by slot row
// like the window's keys: a chunk's rows get their own-chunk terms when it
// enters and the look-back terms of the next chunk, then go out to dkeys and
// dv once. The look-back terms of a sweep's first chunk belong to another
// sweep's rows: they wait in `boundary` until every sweep is done.
template <class T>
void backward_entry(const Call& c, const T* Q, const T* V, const T* out, const T* lse, const T* dout, T* dq, T* dv) {
  const int64_t L = c.L, E = c.E, Ev = c.Ev, C = c.o.chunk;
  const T scale = T(c.scale);
  Buffer<T> norms(L), dkeys(L * E, T(0)), D(L);
  row_norms(c, Q, norms);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < L; ++i) {
    T d = 0;
    for (int64_t e = 0; e < Ev; ++e) d += dout[i * Ev + e] * out[i * Ev + e];
    D[i] = d;
  }
  Buffer<bool> seen(L, false);  // some round gave the query another key
  Buffer<int64_t> bucket(L), order(L);
  const Chunks ch(L, C);
  const int64_t sweeps = (ch.count + kSweep - 1) / kSweep;
  Buffer<T> boundary(sweeps * C * (E + Ev));  // per sweep: C × E key gradients, then C × Ev value gradients
  for (int64_t r = 0; r < c.o.hashes; ++r) {
    hash_round(c, r, Q, bucket.data());
    sort_by_bucket(bucket.data(), L, c.o.buckets, order.data());
    sweep_chunks<T, BackwardScratch<T>>(c, ch, order.data(), Q, norms.data(), V, [&](Window<T>& w, BackwardScratch<T>& x,
                                                                                       int64_t cc, bool fresh) {
      const int64_t n = w.n, m = w.m, own = w.first(w.own), back = w.first(w.other()), back_rows = w.rows[w.other()];
      auto clear = [&](int64_t at, int64_t count) {
        std::fill(&x.dk[size_t(at * E)], &x.dk[size_t((at + count) * E)], T(0));
        std::fill(&x.dvs[size_t(at * Ev)], &x.dvs[size_t((at + count) * Ev)], T(0));
      };
      auto flush = [&](int64_t at, int64_t count) {  // slot rows [at, at + count) out to their positions
        for (int64_t t = at; t < at + count; ++t) {
          const int64_t j = w.pos[size_t(t)];
          for (int64_t e = 0; e < E; ++e) dkeys[j * E + e] += x.dk[size_t(t * E + e)];
          for (int64_t e = 0; e < Ev; ++e) dv[j * Ev + e] += x.dvs[size_t(t * Ev + e)];
        }
      };
      clear(own, n);
      if (fresh) clear(back, back_rows);
      for (int64_t a = 0; a < n; ++a) {  // P = exp(s - lse): 0 where s = -inf
        const int64_t i = w.qpos()[a];
        std::copy(dout + i * Ev, dout + (i + 1) * Ev, &x.dov[size_t(a * Ev)]);
        T* s = &w.s[size_t(a * m)];
        if (std::any_of(s, s + m, [](T logit) { return logit != -INFINITY; })) seen[i] = true;
        exp_row(s, m, lse[i]);
      }
      cpu::gemm<T>(false, true, n, m, Ev, T(1), x.dov.data(), Ev, w.values(), Ev, T(0), x.ds.data(), m);  // dout·v_j
      for (int64_t a = 0; a < n; ++a) {
        const T d = D[w.qpos()[a]];
        for (int64_t t = 0; t < m; ++t) x.ds[size_t(a * m + t)] = w.s[size_t(a * m + t)] * (x.ds[size_t(a * m + t)] - d);
      }
      cpu::gemm<T>(false, false, n, E, m, scale, x.ds.data(), m, w.keys(), E, T(0), x.dqw.data(), E);
      cpu::gemm<T>(true, false, m, E, n, scale, x.ds.data(), m, w.q.data(), E, T(1), &x.dk[size_t(w.lo * E)], E);
      cpu::gemm<T>(true, false, m, Ev, n, T(1), w.s.data(), m, x.dov.data(), Ev, T(1), &x.dvs[size_t(w.lo * Ev)], Ev);
      for (int64_t a = 0; a < n; ++a) {
        const int64_t i = w.qpos()[a];
        for (int64_t e = 0; e < E; ++e) dq[i * E + e] += x.dqw[size_t(a * E + e)];
      }
      if (fresh) {
        T* b = boundary.data() + (cc / kSweep) * C * (E + Ev);
        std::copy(&x.dk[size_t(back * E)], &x.dk[size_t((back + back_rows) * E)], b);
        std::copy(&x.dvs[size_t(back * Ev)], &x.dvs[size_t((back + back_rows) * Ev)], b + C * E);
      } else {
        flush(back, back_rows);  // the previous chunk is complete
      }
      if (cc + 1 == ch.count || (cc + 1) % kSweep == 0) flush(own, n);  // the sweep's last chunk
    });
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < sweeps; ++g) {  // c → previous(c) is one to one: no two write a row
      const int64_t prev = ch.previous(g * kSweep);
      if (prev < 0) continue;
      const T* b = boundary.data() + g * C * (E + Ev);
      for (int64_t a = 0; a < ch.size(prev); ++a) {
        const int64_t j = order[ch.begin(prev) + a];
        for (int64_t e = 0; e < E; ++e) dkeys[j * E + e] += b[a * E + e];
        for (int64_t e = 0; e < Ev; ++e) dv[j * Ev + e] += b[C * E + a * Ev + e];
      }
    }
  }
  Buffer<T> keys(L * E);  // each row's own normalised key (one per row: no per-thread copy to allocate)
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < L; ++i) {
    T* k = keys.data() + i * E;
    if (!seen[i])  // out_i = v_i
      for (int64_t e = 0; e < Ev; ++e) dv[i * Ev + e] += dout[i * Ev + e];
    const T norm = norms[i];
    if (norm == T(0)) continue;
    normalise(Q + i * E, norm, E, k);
    const T* dk = dkeys.data() + i * E;
    T dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += k[size_t(e)] * dk[e];
    for (int64_t e = 0; e < E; ++e) dq[i * E + e] += (dk[e] - k[size_t(e)] * dot) / norm;
  }
}

// ---- The definition, query by query -------------------------------------------
//
// For inputs that hold a NaN or infinity. The chunk products multiply the
// self and causal exclusions as weight 0 (0·NaN = NaN) and so cannot say which
// rows depend on a non-finite input; here each query reads only its keys, so a
// NaN reaches exactly the outputs and gradients whose formula reads it.
// O(L·keys·(E + Ev)).

// The keys each query reads, with how many rounds give it each: its sorted
// chunk and the one before, itself excluded (causal: earlier positions only).
template <class T>
std::vector<std::vector<std::pair<int64_t, int>>> key_counts(const Call& c, const T* Q) {
  const int64_t L = c.L;
  const Chunks ch(L, c.o.chunk);
  std::vector<std::vector<int64_t>> read(static_cast<size_t>(L));  // every key read, once a round that gives it
  Buffer<int64_t> bucket(L), order(L);
  for (int64_t r = 0; r < c.o.hashes; ++r) {
    hash_round(c, r, Q, bucket.data());
    sort_by_bucket(bucket.data(), L, c.o.buckets, order.data());
    for (int64_t cc = 0; cc < ch.count; ++cc)
      for (int64_t a = ch.begin(cc); a < ch.begin(cc) + ch.size(cc); ++a)
        for (int64_t seen : {cc, ch.previous(cc)}) {
          if (seen < 0) continue;
          for (int64_t x = ch.begin(seen); x < ch.begin(seen) + ch.size(seen); ++x) {
            const int64_t i = order[a], j = order[x];
            if (j != i && (!c.o.causal || j < i)) read[size_t(i)].push_back(j);
          }
        }
  }
  std::vector<std::vector<std::pair<int64_t, int>>> keys(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) {
    std::vector<int64_t>& r = read[size_t(i)];
    std::sort(r.begin(), r.end());
    for (size_t x = 0; x < r.size(); ++x)
      if (x == 0 || r[x] != r[x - 1]) keys[size_t(i)].push_back({r[x], 1});
      else ++keys[size_t(i)].back().second;
  }
  return keys;
}

template <class T>
void forward_exact(const Call& c, const T* Q, const T* V, T* out, T* lse) {
  const int64_t L = c.L, E = c.E, Ev = c.Ev;
  const T scale = T(c.scale);
  const auto keys = key_counts(c, Q);
  Buffer<T> norms(L), k(L * E);
  row_norms(c, Q, norms);
  for (int64_t j = 0; j < L; ++j) normalise(Q + j * E, norms[j], E, &k[j * E]);
  for (int64_t i = 0; i < L; ++i) {
    T* o = out + i * Ev;
    if (keys[size_t(i)].empty()) {  // nothing but itself: weight 1 on its own value
      std::copy(V + i * Ev, V + (i + 1) * Ev, o);
      lse[i] = scale * norms[i];
      continue;
    }
    T max = -INFINITY;
    bool nan = false;
    for (auto [j, n] : keys[size_t(i)]) {
      const T s = scale * dot(Q + i * E, &k[j * E], E);
      if (s != s) nan = true;
      else if (s > max) max = s;
    }
    if (nan) max = T(NAN);
    T sum = 0;
    std::fill(o, o + Ev, T(0));
    for (auto [j, n] : keys[size_t(i)]) {
      const T w = T(n) * std::exp(scale * dot(Q + i * E, &k[j * E], E) - max);
      sum += w;
      for (int64_t e = 0; e < Ev; ++e) o[e] += w * V[j * Ev + e];
    }
    for (int64_t e = 0; e < Ev; ++e) o[e] /= sum;
    lse[i] = max + std::log(sum);
  }
}

// P_ij = n_ij e^(s_ij - lse_i), dS_ij = P_ij (dout_i·v_j - dout_i·out_i);
// dq_i += scale dS_ij k_j, dk_j += scale dS_ij q_i, dv_j += P_ij dout_i; then
// through k = q / |q|: dq_j += (dk_j - k_j (k_j·dk_j)) / |q_j|.
template <class T>
void backward_exact(const Call& c, const T* Q, const T* V, const T* out, const T* lse, const T* dout, T* dq, T* dv) {
  const int64_t L = c.L, E = c.E, Ev = c.Ev;
  const T scale = T(c.scale);
  const auto keys = key_counts(c, Q);
  Buffer<T> norms(L), k(L * E), dk(L * E, T(0));
  row_norms(c, Q, norms);
  for (int64_t j = 0; j < L; ++j) normalise(Q + j * E, norms[j], E, &k[j * E]);
  std::fill(dq, dq + L * E, T(0));
  std::fill(dv, dv + L * Ev, T(0));
  for (int64_t i = 0; i < L; ++i) {
    const T* d = dout + i * Ev;
    if (keys[size_t(i)].empty()) {  // out_i = v_i
      for (int64_t e = 0; e < Ev; ++e) dv[i * Ev + e] += d[e];
      continue;
    }
    const T D = dot(d, out + i * Ev, Ev);
    for (auto [j, n] : keys[size_t(i)]) {
      const T p = T(n) * std::exp(scale * dot(Q + i * E, &k[j * E], E) - lse[i]);
      const T ds = p * (dot(d, V + j * Ev, Ev) - D);
      for (int64_t e = 0; e < E; ++e) {
        dq[i * E + e] += scale * ds * k[j * E + e];
        dk[j * E + e] += scale * ds * Q[i * E + e];
      }
      for (int64_t e = 0; e < Ev; ++e) dv[j * Ev + e] += p * d[e];
    }
  }
  for (int64_t j = 0; j < L; ++j) {
    if (norms[j] == T(0)) continue;
    const T kd = dot(&k[j * E], &dk[j * E], E);
    for (int64_t e = 0; e < E; ++e) dq[j * E + e] += (dk[j * E + e] - k[j * E + e] * kd) / norms[j];
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
    if (!all_finite(r.out) || !all_finite(r.lse))  // a NaN or infinity: the exact definition instead
      for (int64_t b = 0; b < c.batch; ++b)
        forward_exact<T>(c, q.data<T>() + b * c.L * c.E, v.data<T>() + b * c.L * c.Ev, r.out.data<T>() + b * c.L * c.Ev,
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
    if (!all_finite(g.dquery) || !all_finite(g.dvalue))
      for (int64_t b = 0; b < c.batch; ++b)
        backward_exact<T>(c, q.data<T>() + b * c.L * c.E, v.data<T>() + b * c.L * c.Ev, o.data<T>() + b * c.L * c.Ev,
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
