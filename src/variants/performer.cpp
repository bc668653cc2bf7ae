// Performer (FAVOR+): positive orthogonal random features on the shared
// feature-map core. The derivation and the stabilisers are in
// include/mha/variants/performer.h.
#include "mha/variants/performer.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/gemm.h"
#include "mha/random.h"
#include "variants/feature_attention.h"

namespace mha {

namespace {

template <class T>
struct RandomFeatures {
  int64_t L, S, E, m;
  const T* w;    // (m, E)
  T sqrt_scale;  // x = √scale · q, y = √scale · k

  void features(const T* q, const T* k, T* phi_q, T* phi_k) const {
    cpu::gemm<T>(false, true, L, m, E, sqrt_scale, q, E, w, E, T(0), phi_q, m);  // ω_r·x_i
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < L; ++i) {  // exp(ω_r·x - max_r ω_r·x): the row's constants cancel
      T* row = phi_q + i * m;
      const T max = *std::max_element(row, row + m);
      for (int64_t r = 0; r < m; ++r) row[r] = std::exp(row[r] - max);
    }
    cpu::gemm<T>(false, true, S, m, E, sqrt_scale, k, E, w, E, T(0), phi_k, m);  // ω_r·y_j
    T c = -INFINITY;  // the largest exponent over all keys
#pragma omp parallel for schedule(static) reduction(max : c)
    for (int64_t j = 0; j < S; ++j) {
      T* row = phi_k + j * m;
      const T half_norm = half_square(k + j * E);
      for (int64_t r = 0; r < m; ++r) {
        row[r] -= half_norm;
        c = std::max(c, row[r]);
      }
    }
#pragma omp parallel for schedule(static)
    for (int64_t x = 0; x < S * m; ++x) phi_k[x] = std::exp(phi_k[x] - c);
  }

  // |y|²/2 = scale · |k|² / 2
  T half_square(const T* k) const {
    T s = 0;
    for (int64_t e = 0; e < E; ++e) s += k[e] * k[e];
    return sqrt_scale * sqrt_scale * s / T(2);
  }

  void gradients(const T* q, const T* k, const T* phi_q, const T* phi_k, T* dphi_q, T* dphi_k, T* dq, T* dk) const {
    (void)q;
#pragma omp parallel for schedule(static)
    for (int64_t x = 0; x < L * m; ++x) dphi_q[x] *= phi_q[x];  // d(exponent) = dφ ∘ φ
    cpu::gemm<T>(false, false, L, E, m, sqrt_scale, dphi_q, m, w, E, T(0), dq, E);  // dq = √scale Σ_r d_r ω_r
#pragma omp parallel for schedule(static)
    for (int64_t x = 0; x < S * m; ++x) dphi_k[x] *= phi_k[x];
    cpu::gemm<T>(false, false, S, E, m, sqrt_scale, dphi_k, m, w, E, T(0), dk, E);
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < S; ++j) {  // the -|y|²/2 term: dk_j -= scale · (Σ_r d_jr) k_j
      T t = 0;
      for (int64_t r = 0; r < m; ++r) t += dphi_k[j * m + r];
      const T f = sqrt_scale * sqrt_scale * t;
      for (int64_t e = 0; e < E; ++e) dk[j * E + e] -= f * k[j * E + e];
    }
  }
};

int64_t check_features(const Tensor& features, const Tensor& query, const std::string& fn) {
  variants::check_operand(features, fn, "options.features", "(m, E)");
  if (features.dim() != 2) raise<ShapeError>(fn, "options.features", "2 dims (m, E)", shape_string(features.shape()));
  variants::check_same_dtype(features, query, fn, "options.features", "query");
  variants::check_size(features, -1, query.size(-1), fn, "options.features", "E = " + std::to_string(query.size(-1)) + " (query's)");
  return features.size(0);
}

struct PerformerCall {
  int64_t m;
  Tensor w;  // contiguous features
  double sqrt_scale;
};

PerformerCall check_performer(const Tensor& query, const PerformerOptions& o, const std::string& fn) {
  const int64_t m = check_features(o.features, query, fn);
  const double scale = variants::resolve_scale(o.scale, query.size(-1), fn);
  if (scale < 0)
    raise<ValueError>(fn, "scale", "a scale >= 0 (the kernel exp(scale·q·k) is estimated through √scale)",
                      std::to_string(scale));
  return {m, o.features.contiguous(), std::sqrt(scale)};
}

}  // namespace

Tensor performer_features(int64_t features, int64_t head_dim, uint64_t seed, DType dtype, bool orthogonal) {
  const std::string fn = "mha::performer_features";
  variants::check_at_least(features, 1, fn, "features");
  variants::check_at_least(head_dim, 1, fn, "head_dim");
  if (dtype != DType::float32 && dtype != DType::float64) raise<DtypeError>(fn, "dtype", "float32 or float64", to_string(dtype));
  Generator gen(seed);
  Tensor w = randn({features, head_dim}, gen, 0.0, 1.0, DType::float64);
  if (!orthogonal) return w.to(dtype);
  const Tensor norms = randn({features, head_dim}, gen, 0.0, 1.0, DType::float64);
  double* a = w.data<double>();
  const double* g = norms.data<double>();
  const int64_t E = head_dim;
  for (int64_t r = 0; r < features; ++r) {  // Gram-Schmidt within blocks of E rows: orthonormal rows
    double* row = a + r * E;
    for (int64_t p = r - r % E; p < r; ++p) {
      const double* prev = a + p * E;
      double dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += row[e] * prev[e];
      for (int64_t e = 0; e < E; ++e) row[e] -= dot * prev[e];
    }
    double len = 0;
    for (int64_t e = 0; e < E; ++e) len += row[e] * row[e];
    for (int64_t e = 0; e < E; ++e) row[e] /= std::sqrt(len);
  }
  for (int64_t r = 0; r < features; ++r) {  // each row the length of an independent N(0, I) vector
    double chi = 0;
    for (int64_t e = 0; e < E; ++e) chi += g[r * E + e] * g[r * E + e];
    for (int64_t e = 0; e < E; ++e) a[r * E + e] *= std::sqrt(chi);
  }
  return w.to(dtype);
}

LinearAttentionOutput performer_attention_forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                                  const PerformerOptions& options) {
  const std::string fn = "mha::performer_attention_forward";
  const variants::QkvSizes n = variants::check_feature_call(query, key, value, options.causal, fn);
  const PerformerCall c = check_performer(query, options, fn);
  return variants::feature_map_forward(query, key, value, n, c.m, options.causal, [&](auto tag) {
    using T = decltype(tag);
    return RandomFeatures<T>{n.L, n.S, n.E, c.m, c.w.data<T>(), T(c.sqrt_scale)};
  });
}

AttentionGradients performer_attention_backward(const Tensor& dout, const Tensor& query, const Tensor& key,
                                                const Tensor& value, const LinearAttentionOutput& forward,
                                                const PerformerOptions& options) {
  const std::string fn = "mha::performer_attention_backward";
  const variants::QkvSizes n = variants::check_feature_call(query, key, value, options.causal, fn);
  const PerformerCall c = check_performer(query, options, fn);
  return variants::feature_map_backward(dout, query, key, value, forward, n, c.m, options.causal, fn, [&](auto tag) {
    using T = decltype(tag);
    return RandomFeatures<T>{n.L, n.S, n.E, c.m, c.w.data<T>(), T(c.sqrt_scale)};
  });
}

}  // namespace mha
