// Normalised feature-map attention for one batch entry, the core that linear
// attention (elu + 1) and Performer (random features) share:
//   out_i = φq_iᵀ Σ_j φk_j v_jᵀ / φq_iᵀ Σ_j φk_j   (causal: j <= i)
// given the feature maps φq (L × F) and φk (S × F). The derivation is in
// include/mha/variants/linear_attention.h.
#pragma once

#include <cstdint>
#include <string>

#include "mha/variants/linear_attention.h"
#include "variants/common.h"

namespace mha::variants {

struct FeatureAttentionShape {
  int64_t L = 0, S = 0, F = 0, Ev = 0;
  bool causal = false;  // requires L = S
};

// Writes out (L × Ev) and normalizer (L). Rows whose normalizer underflows
// (below √(smallest normal): 1/den would overflow in backward) get out 0,
// normalizer 0 and zero gradient.
template <class T>
void feature_attention_forward(const FeatureAttentionShape& n, const T* phi_q, const T* phi_k, const T* v, T* out,
                               T* normalizer);

// Writes dphi_q (L × F), dphi_k (S × F) and dv (S × Ev) from dout (L × Ev) and
// the forward's out and normalizer.
template <class T>
void feature_attention_backward(const FeatureAttentionShape& n, const T* phi_q, const T* phi_k, const T* v,
                                const T* out, const T* normalizer, const T* dout, T* dphi_q, T* dphi_k, T* dv);

// ---- The driver shared by linear attention and Performer ----------------------
//
// A feature map for one batch entry has
//   void features(const T* q, const T* k, T* phi_q, T* phi_k) const;   // L × F, S × F
//   void gradients(const T* q, const T* k, const T* phi_q, const T* phi_k,
//                  T* dphi_q, T* dphi_k, T* dq, T* dk) const;          // may overwrite dphi_*
// and make_map(T{}) builds it for the element type T.

// Checks shared by both: the triple, and causal needs L = S.
QkvSizes check_feature_call(const Tensor& query, const Tensor& key, const Tensor& value, bool causal,
                            const std::string& fn);

template <class MakeMap>
LinearAttentionOutput feature_map_forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                          const QkvSizes& n, int64_t F, bool causal, MakeMap&& make_map) {
  const Shape lead = leading(query.shape(), 2);
  LinearAttentionOutput r{Tensor::empty(with_tail(lead, {n.L, n.Ev}), query.dtype()),
                          Tensor::empty(with_tail(lead, {n.L}), query.dtype())};
  dispatch_real(query.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const auto map = make_map(T{});
    const Tensor q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
    Buffer<T> pq(n.L * F), pk(n.S * F);
    const FeatureAttentionShape shape{n.L, n.S, F, n.Ev, causal};
    for (int64_t b = 0; b < n.batch; ++b) {
      const T* qb = q.data<T>() + b * n.L * n.E;
      const T* kb = k.data<T>() + b * n.S * n.E;
      map.features(qb, kb, pq.data(), pk.data());
      feature_attention_forward(shape, pq.data(), pk.data(), v.data<T>() + b * n.S * n.Ev,
                                r.out.data<T>() + b * n.L * n.Ev, r.normalizer.data<T>() + b * n.L);
    }
  });
  return r;
}

template <class MakeMap>
AttentionGradients feature_map_backward(const Tensor& dout, const Tensor& query, const Tensor& key, const Tensor& value,
                                        const LinearAttentionOutput& forward, const QkvSizes& n, int64_t F, bool causal,
                                        const std::string& fn, MakeMap&& make_map) {
  const Shape lead = leading(query.shape(), 2);
  check_saved(dout, with_tail(lead, {n.L, n.Ev}), {{&forward.out, "forward.out"}}, with_tail(lead, {n.L}),
              {{&forward.normalizer, "forward.normalizer"}}, query.dtype(), fn);
  AttentionGradients g{Tensor::empty(query.shape(), query.dtype()), Tensor::empty(key.shape(), query.dtype()),
                       Tensor::empty(value.shape(), query.dtype()), Tensor()};
  dispatch_real(query.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const auto map = make_map(T{});
    const Tensor q = query.contiguous(), k = key.contiguous(), v = value.contiguous(), d = dout.contiguous(),
                 o = forward.out.contiguous(), den = forward.normalizer.contiguous();
    Buffer<T> pq(n.L * F), pk(n.S * F), dpq(n.L * F), dpk(n.S * F);
    const FeatureAttentionShape shape{n.L, n.S, F, n.Ev, causal};
    for (int64_t b = 0; b < n.batch; ++b) {
      const T* qb = q.data<T>() + b * n.L * n.E;
      const T* kb = k.data<T>() + b * n.S * n.E;
      map.features(qb, kb, pq.data(), pk.data());
      feature_attention_backward(shape, pq.data(), pk.data(), v.data<T>() + b * n.S * n.Ev, o.data<T>() + b * n.L * n.Ev,
                                 den.data<T>() + b * n.L, d.data<T>() + b * n.L * n.Ev, dpq.data(), dpk.data(),
                                 g.dvalue.data<T>() + b * n.S * n.Ev);
      map.gradients(qb, kb, pq.data(), pk.data(), dpq.data(), dpk.data(), g.dquery.data<T>() + b * n.L * n.E,
                    g.dkey.data<T>() + b * n.S * n.E);
    }
  });
  return g;
}

}  // namespace mha::variants
