// Linear attention with the feature map φ(x) = elu(x) + 1 (Katharopoulos et
// al., 2020) on the shared feature-map core (variants/feature_attention.h).
#include "mha/variants/linear_attention.h"

#include <cmath>

#include "variants/feature_attention.h"

namespace mha {

namespace {

// φ(x) = x + 1 for x > 0, e^x otherwise; φ'(x) = 1 for x > 0, e^x = φ(x) otherwise.
template <class T>
struct EluPlusOne {
  int64_t L, S, E;

  static void map(const T* x, T* phi, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) phi[i] = x[i] > T(0) ? x[i] + T(1) : std::exp(x[i]);
  }
  static void chain(const T* x, const T* phi, const T* dphi, T* dx, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) dx[i] = x[i] > T(0) ? dphi[i] : dphi[i] * phi[i];
  }
  void features(const T* q, const T* k, T* phi_q, T* phi_k) const {
    map(q, phi_q, L * E);
    map(k, phi_k, S * E);
  }
  void gradients(const T* q, const T* k, const T* phi_q, const T* phi_k, T* dphi_q, T* dphi_k, T* dq, T* dk) const {
    chain(q, phi_q, dphi_q, dq, L * E);
    chain(k, phi_k, dphi_k, dk, S * E);
  }
};

}  // namespace

LinearAttentionOutput linear_attention_forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                               const LinearAttentionOptions& options) {
  const std::string fn = "mha::linear_attention_forward";
  const variants::QkvSizes n = variants::check_feature_call(query, key, value, options.causal, fn);
  return variants::feature_map_forward(query, key, value, n, n.E, options.causal, [&](auto tag) {
    return EluPlusOne<decltype(tag)>{n.L, n.S, n.E};
  });
}

AttentionGradients linear_attention_backward(const Tensor& dout, const Tensor& query, const Tensor& key,
                                             const Tensor& value, const LinearAttentionOutput& forward,
                                             const LinearAttentionOptions& options) {
  const std::string fn = "mha::linear_attention_backward";
  const variants::QkvSizes n = variants::check_feature_call(query, key, value, options.causal, fn);
  return variants::feature_map_backward(dout, query, key, value, forward, n, n.E, options.causal, fn, [&](auto tag) {
    return EluPlusOne<decltype(tag)>{n.L, n.S, n.E};
  });
}

}  // namespace mha
