// Test helpers: random tensors, a textbook attention in double, exception
// checks, and a finite-difference gradient check.
#pragma once

#include <gtest/gtest.h>

#include <stdlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "mha/mha.h"
#include "random/philox.h"

namespace mha::testing {

// A fresh folder under the system's temporary folder: prefix + "XXXXXX".
inline std::string temp_dir(const std::string& prefix = "mha_test_") {
  std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "XXXXXX")).string();
  return mkdtemp(tmpl.data());
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

inline Tensor random_tensor(const Shape& shape, uint64_t seed, DType dtype = DType::float64, double stddev = 1.0) {
  Generator gen(seed);
  return randn(shape, gen, 0.0, stddev, dtype);
}

inline double max_abs(const Tensor& a) {
  double m = 0;
  for (double x : a.to_vector()) m = std::max(m, std::abs(x));
  return m;
}

inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  std::vector<double> x = a.to_vector(), y = b.to_vector();
  double m = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

inline bool all_finite(const Tensor& t) {
  for (double x : t.to_vector())
    if (!std::isfinite(x)) return false;
  return true;
}

// Index of `t`'s element for output batch index `b` (right-aligned); a dim of
// size n against N reads b / (N / n) (broadcast and grouped-query heads).
inline Shape source_index(const Tensor& t, const Shape& batch, const Shape& b, int64_t row, int64_t col) {
  const size_t lead = size_t(t.dim()) - 2, off = batch.size() - lead;
  Shape idx(lead + 2);
  for (size_t d = 0; d < lead; ++d) idx[d] = b[off + d] / (batch[off + d] / t.size(int64_t(d)));
  idx[lead] = row;
  idx[lead + 1] = col;
  return idx;
}

struct Naive {
  Tensor out, weights, lse;  // float64
};

// softmax(Q Kᵀ scale + mask) V computed row by row in double, straight from
// the definition, with index arithmetic independent of the library's.
inline Naive naive_attention(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& o,
                             const Shape& batch) {
  const int64_t L = q.size(-2), S = k.size(-2), E = q.size(-1), Ev = v.size(-1);
  const double scale = o.scale ? *o.scale : 1.0 / std::sqrt(double(E));
  const int64_t B = shape_numel(batch);
  Shape os = batch, ws = batch, ls = batch;
  os.insert(os.end(), {L, Ev});
  ws.insert(ws.end(), {L, S});
  ls.push_back(L);
  Naive r{Tensor::zeros(os, DType::float64), Tensor::zeros(ws, DType::float64), Tensor::zeros(ls, DType::float64)};
  Tensor mask_full;
  if (o.mask.defined()) mask_full = o.mask.expand(ws);
  const uint32_t threshold = dropout_threshold(o.dropout_p);
  for (int64_t flat = 0; flat < B; ++flat) {
    Shape b(batch.size());
    for (int64_t rem = flat, d = int64_t(batch.size()) - 1; d >= 0; --d) {
      b[size_t(d)] = rem % batch[size_t(d)];
      rem /= batch[size_t(d)];
    }
    for (int64_t i = 0; i < L; ++i) {
      std::vector<double> s(static_cast<size_t>(S));
      double max = -INFINITY;
      for (int64_t j = 0; j < S; ++j) {
        double x = 0;
        for (int64_t e = 0; e < E; ++e) x += q.item(source_index(q, batch, b, i, e)) * k.item(source_index(k, batch, b, j, e));
        x *= scale;
        if (mask_full.defined()) {
          Shape mi = b;
          mi.insert(mi.end(), {i, j});
          const double m = mask_full.item(mi);
          if (o.mask.dtype() == DType::boolean) x = m != 0 ? x : -INFINITY;
          else x += m;
        }
        const int64_t shift = o.causal == Causal::bottom_right ? S - L : 0;
        if (o.causal != Causal::none && j > i + shift) x = -INFINITY;
        s[size_t(j)] = x;
        max = std::max(max, x);
      }
      Shape li = b;
      li.push_back(i);
      if (max == -INFINITY) {
        r.lse.set_item(li, -INFINITY);
        continue;
      }
      double sum = 0;
      for (double x : s) sum += std::exp(x - max);
      r.lse.set_item(li, max + std::log(sum));
      for (int64_t j = 0; j < S; ++j) {
        double p = std::exp(s[size_t(j)] - max) / sum;
        if (o.dropout_p > 0)
          p = dropout_keep(o.dropout_seed, uint64_t(flat), uint64_t(i), uint64_t(j), threshold) ? p / (1 - o.dropout_p) : 0.0;
        Shape wi = b;
        wi.insert(wi.end(), {i, j});
        r.weights.set_item(wi, p);
        for (int64_t e = 0; e < Ev; ++e) {
          Shape oi = b;
          oi.insert(oi.end(), {i, e});
          r.out.set_item(oi, r.out.item(oi) + p * v.item(source_index(v, batch, b, j, e)));
        }
      }
    }
  }
  return r;
}

// Runs f, expects an exception of type E, and checks that each fragment is in its message.
template <class E, class F>
void expect_error(F&& f, std::initializer_list<const char*> fragments) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one containing " << *fragments.begin();
  } catch (const E& e) {
    const std::string what = e.what();
    for (const char* frag : fragments) EXPECT_NE(what.find(frag), std::string::npos) << "'" << frag << "' not in: " << what;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}
template <class E, class F>
void expect_error(F&& f, const std::string& fragment) {
  expect_error<E>(std::forward<F>(f), {fragment.c_str()});
}

// Relative error ||analytic - numeric|| / max(||analytic||, ||numeric||) of
// the gradient of loss() with respect to the float64 tensor x, by central
// differences. loss() must read x's current values.
inline double gradient_error(Tensor x, const Tensor& analytic, const std::function<double()>& loss, double h = 1e-6) {
  EXPECT_EQ(x.dtype(), DType::float64);
  EXPECT_EQ(analytic.shape(), x.shape());
  std::vector<double> a = analytic.to_vector();
  double diff = 0, na = 0, nn = 0;
  size_t flat = 0;
  const Shape shape = x.shape();
  Shape idx(shape.size(), 0);
  for (int64_t n = 0; n < x.numel(); ++n, ++flat) {
    for (int64_t rem = n, d = int64_t(shape.size()) - 1; d >= 0; --d) {
      idx[size_t(d)] = rem % shape[size_t(d)];
      rem /= shape[size_t(d)];
    }
    const double x0 = x.item(idx);
    x.set_item(idx, x0 + h);
    const double up = loss();
    x.set_item(idx, x0 - h);
    const double down = loss();
    x.set_item(idx, x0);
    const double numeric = (up - down) / (2 * h);
    diff += (a[flat] - numeric) * (a[flat] - numeric);
    na += a[flat] * a[flat];
    nn += numeric * numeric;
  }
  const double denom = std::max(std::sqrt(std::max(na, nn)), 1e-12);
  return std::sqrt(diff) / denom;
}

// Σ out ∘ weights: a scalar loss whose gradient with respect to out is `weights`.
inline double weighted_sum(const Tensor& out, const Tensor& weights) {
  std::vector<double> a = out.to_vector(), w = weights.to_vector();
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * w[i];
  return s;
}

}  // namespace mha::testing
